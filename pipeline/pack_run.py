"""Stage pack-safetensors' run (``stages/pack_safetensors.py``): one format's direct cast (stage direct-cast's packed
bytes as they are) and QAT student (at the quantiser state and scales it was trained with,
:func:`pipeline.qat.api.convert`) written as Hugging Face model directories under ``models/packed/<format>/``
(:func:`pipeline.hf.write.write_model_dir`), with their sizes and bits per weight for ``reports/pack/<format>.json``."""

from __future__ import annotations

from dataclasses import asdict

from pipeline.cast.direct import DirectCast
from pipeline.cast.fit import check_states
from pipeline.formats import FormatBase
from pipeline.formats.base import check_weight
from pipeline.hf.write import write_model_dir
from pipeline.files.atomic import atomic_dir
from pipeline.models import dtype_of, load_config
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.formats.precision import Precision
from pipeline.cast.ptq import PackParams
from pipeline.qat.api import convert
from pipeline.stage import console, progress, versions
from pipeline.teacher.source import TeacherParams, local_dir


METHODS = ("direct-cast", "qat")


def pack_models(fmt: FormatBase, p: PackParams, teacher: TeacherParams, methods=METHODS,
                out_root: str = "models/packed") -> dict:
    """Write ``<out_root>/<format>/{direct-cast,qat}/`` (``methods``: a direct cast alone can be packed and scored
    before any QAT); returns the report (per model: size, bits)."""
    if not methods or set(methods) - set(METHODS):
        raise ValueError(f"methods: {list(methods)!r}; choose from {', '.join(METHODS)}")
    state_file = f"data/centroids/{fmt.name}.safetensors"
    states = check_states(fmt, fmt.load_states(state_file), state_file)
    config = load_config(teacher.dir).to_dict()
    teacher_dir = local_dir(teacher.dir)
    cast = DirectCast(f"models/direct-cast/{fmt.name}", fmt, p.algorithm)
    plan = Precision(fmt, p.precision)
    states = {n: st for n, st in states.items() if plan.format_of(n) is not None}   # bf16: kept as it is
    other = {n: f for n in states if (f := plan.format_of(n)) is not fmt}
    report = {}
    # a rotated teacher (teacher.rotate) is another basis of the same model: the packed file says which
    rotated = {"rotate": teacher.rotate, "rotate_seed": teacher.rotate_seed} if teacher.rotate != "none" else {}
    trained = convert(f"models/qat/{fmt.name}", plan) if "qat" in methods else None
    sources = {"direct-cast": teacher_dir, "qat": f"models/qat/{fmt.name}"}
    with atomic_dir(f"{out_root}/{fmt.name}") as out:
        for method in (m for m in METHODS if m in methods):
            source = sources[method]
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
    return report


def checked(encode, reader: CheckpointReader):
    """``encode`` of weights checked first: a NaN or Inf is refused naming the checkpoint tensor and its file."""

    def encode_checked(name, weight, state):
        check_weight(weight, f"{reader.file_of(f'{name}.weight')}: tensor {name}.weight")
        return encode(name, weight, state)

    return encode_checked

