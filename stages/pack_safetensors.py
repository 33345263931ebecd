"""DVC stage pack-safetensors: pack one format's direct-cast and QAT models into Hugging Face model directories.

    python stages/pack_safetensors.py --format s3d8

``models/packed/<format>/direct-cast/`` (the teacher's weights cast straight to the format) and
``models/packed/<format>/qat/`` (the QAT student's fp32 masters), each a Hugging Face directory
(``pipeline/hf.py``): ``config.json`` with a ``quantization_config``, the processor files,
``generation_config.json``, a model card and ``model.safetensors`` laid out as SPEC section 7 (S3D8:
readable by the Llama-Mobile reference loader) or our documented scalar layout, sharded with an index above
``pipeline.hf.MAX_SHARD_SIZE``. Streams tensor by tensor; S3D8 uses the native encoder. Sizes and bits per
parameter go to ``reports/pack/<format>.json``. The direct cast uses ``pack.method`` (``pipeline.ptq``);
``gptq`` reads the teacher's ``X^T X`` per Linear from ``data/calibration/hessians.safetensors`` (stage
calibrate).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from safetensors import safe_open

from pipeline import formats, params, ptq
from pipeline.checkpoint import CheckpointReader
from pipeline.fit import check_states
from pipeline.hf import write_model_dir
from pipeline.io import atomic_dir, write_json
from pipeline.models import dtype_of, load_config
from pipeline.packed import PackParams
from pipeline.stage import console, progress, stage_errors, versions
from pipeline.teacher import TeacherParams, local_dir

CALIBRATION = "data/calibration/hessians.safetensors"


class Calibration:
    """The teacher's ``X^T X`` per Linear weight (stage calibrate), read one matrix at a time; ``get`` gives None
    for a weight without one (embeddings: GPTQ falls back to the scale search) or when no file is used."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.names = set()
        if path is not None:
            with safe_open(path, "pt") as f:
                self.names = set(f.keys())

    def get(self, name: str):
        if name not in self.names:
            return None
        with safe_open(self.path, "pt") as f:
            return f.get_tensor(name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, help=f"one of {', '.join(formats.QUANTISED)}")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    with stage_errors("pack-safetensors"):
        fmt = formats.comparison(args.format, "--format")
        p = params.load(PackParams, "pack", args.params)
        teacher = params.load(TeacherParams, "teacher", args.params)
        state_file = f"data/centroids/{fmt.name}.safetensors"
        states = check_states(fmt, fmt.load_states(state_file), state_file)
        config = load_config(teacher.source).to_dict()
        teacher_dir = local_dir(teacher.source)
        calibration = Calibration(CALIBRATION if p.method == "gptq" else None)
        report = {}
        with atomic_dir(f"models/packed/{fmt.name}") as out:
            for method, source in (("direct-cast", teacher_dir), ("qat", f"models/qat/{fmt.name}")):
                with progress() as bar:
                    task = bar.add_task(f"pack {fmt.name} {method}", total=len(states))
                    # the direct cast by the chosen post-training method; the QAT student as it was trained (absmax)
                    encode = (lambda name, w, state: ptq.pack(fmt.name, w, method=p.method,
                                                              hessian=calibration.get(name))) \
                        if method == "direct-cast" else None
                    summary = write_model_dir(out / method, CheckpointReader(source), fmt, states, encode=encode,
                                              teacher_dir=teacher_dir, method=method, base_model=teacher.source,
                                              teacher_name=teacher.name, dtype=dtype_of(p.dtype),
                                              metadata={"config": config, "method": method,
                                                        "source_model": teacher.source, "teacher": teacher.name,
                                                        "pack_params": asdict(p), **versions()},
                                              progress=lambda name: bar.advance(task))
                report[method] = {"size_mb": summary["file_bytes"] / 1e6,
                                  **{k: v for k, v in summary.items() if k not in ("format", "files")}}
                console.print(f"[green]pack-safetensors[/] {fmt.name} {method}: {report[method]['size_mb']:.2f} MB, "
                              f"{summary['bits_per_param_nominal']:.3f} bits/param nominal, "
                              f"{summary['bits_per_param_actual']:.3f} actual")
        write_json(f"reports/pack/{fmt.name}.json", report)


if __name__ == "__main__":
    main()
