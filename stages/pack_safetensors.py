"""DVC stage pack-safetensors: pack one format's direct-cast and QAT models into Hugging Face model directories.

    python stages/pack_safetensors.py --format s3d8

``models/packed/<format>/direct-cast/`` (the teacher's weights cast straight to the format) and
``models/packed/<format>/qat/`` (the QAT student's fp32 masters), each a Hugging Face directory
(``pipeline/hf.py``): ``config.json`` with a ``quantization_config``, the processor files,
``generation_config.json``, a model card and ``model.safetensors`` laid out as SPEC section 7 (S3D8:
readable by the Llama-Mobile reference loader) or our documented scalar layout, sharded with an index above
``pipeline.hf_config.MAX_SHARD_SIZE``. Streams tensor by tensor; S3D8 uses the native encoder. Sizes and bits per
parameter go to ``reports/pack/<format>.json``. The direct cast is stage direct-cast's
(``models/direct-cast/<format>/``, cast by ``pack.method``), packed as it is.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)

from pipeline import formats, params
from pipeline.checkpoint import CheckpointReader
from pipeline.direct_cast import DirectCast
from pipeline.fit import check_states
from pipeline.formats.base import check_weight
from pipeline.hf_write import write_model_dir
from pipeline.io import atomic_dir, write_json
from pipeline.models import dtype_of, load_config
from pipeline.precision import Precision
from pipeline.ptq import PackParams
from pipeline.qat.api import convert
from pipeline.stage import console, progress, stage_errors, versions
from pipeline.teacher_source import TeacherParams, local_dir

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
        config = load_config(teacher.dir).to_dict()
        teacher_dir = local_dir(teacher.dir)
        cast = DirectCast(f"models/direct-cast/{fmt.name}", fmt, p.method)
        plan = Precision(fmt, p.precision)
        states = {n: st for n, st in states.items() if plan.format_of(n) is not None}   # bf16: kept as it is
        other = {n: f for n in states if (f := plan.format_of(n)) is not fmt}
        report = {}
        # a rotated teacher (teacher.rotate) is another basis of the same model: the packed file says which
        rotated = {"rotate": teacher.rotate, "rotate_seed": teacher.rotate_seed} if teacher.rotate != "none" else {}
        trained = convert(f"models/qat/{fmt.name}", plan)
        with atomic_dir(f"models/packed/{fmt.name}") as out:
            for method, source in (("direct-cast", teacher_dir), ("qat", f"models/qat/{fmt.name}")):
                with progress() as bar:
                    task = bar.add_task(f"pack {fmt.name} {method}", total=len(states))
                    # the direct cast by the chosen post-training method; the QAT student at the quantiser state
                    # and scales it was trained with (learned, or absmax)
                    if method == "direct-cast":
                        encode = lambda name, w, state: cast.packed(name, w.shape)  # noqa: E731
                    else:
                        encode = trained
                    reader = CheckpointReader(source)
                    summary = write_model_dir(out / method, reader, fmt, states, encode=checked(encode, reader),
                                              teacher_dir=teacher_dir, method=method, base_model=teacher.source,
                                              teacher_name=teacher.name, dtype=dtype_of(p.dtype),
                                              metadata={"config": config, "method": method,
                                                        "source_model": teacher.source, "teacher": teacher.name,
                                                        "pack_params": asdict(p), **versions(), **rotated},
                                              progress=lambda name: bar.advance(task), other=other)
                report[method] = {"size_mb": summary["file_bytes"] / 1e6,
                                  **{k: v for k, v in summary.items() if k not in ("format", "files")}}
                console.print(f"[green]pack-safetensors[/] {fmt.name} {method}: {report[method]['size_mb']:.2f} MB, "
                              f"{summary['bits_per_param_nominal']:.3f} bits/param nominal, "
                              f"{summary['bits_per_param_actual']:.3f} actual; bits per weight: whole model "
                              f"{summary['bits_per_weight_whole']:.3f}, decoder Linears "
                              f"{summary['bits_per_weight_linears']:.3f}")
        write_json(f"reports/pack/{fmt.name}.json", report)


def checked(encode, reader: CheckpointReader):
    """``encode`` of weights checked first: a NaN or Inf is refused naming the checkpoint tensor and its file."""

    def encode_checked(name, weight, state):
        check_weight(weight, f"{reader.file_of(f'{name}.weight')}: tensor {name}.weight")
        return encode(name, weight, state)

    return encode_checked


if __name__ == "__main__":
    main()
