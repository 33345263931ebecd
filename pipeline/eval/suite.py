"""The evaluation of a compression run: the bf16 teacher and, for every format, its direct-cast and QAT
models loaded from their packed files, each scored on the tasks and measured by KL to the teacher."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline import formats
from pipeline.eval.kl import HeldoutKL
from pipeline.eval.runner import evaluate
from pipeline.eval.tasks import family_of, load_task
from pipeline.models import dtype_of, load_model, load_processor, token_ids
from pipeline.packed import check_kernel, load_packed_model, read_metadata
from pipeline.params import non_negative, positive
from pipeline.qat.data import load_examples, split_heldout
from pipeline.stage import console
from pipeline.teacher import TeacherParams, local_dir

METHODS = ("direct-cast", "qat")


@dataclass
class EvalParams:
    tasks: list[str] = field(default_factory=lambda: ["toy-vqa", "toy-chartqa", "toy-docvqa", "toy-ai2d"])
    n: int = positive(128)
    seed: int = 0
    batch_size: int = positive(32)
    act_quant: bool = True
    kl_batch_size: int = positive(16)
    max_seq_len: int = positive(160)
    sources: dict[str, str] = field(default_factory=dict)
    blind_baseline: bool = True
    kernel: str = "torch"      # "native": formats with a native kernel run on it (packed bytes, int32 dots)
    threads: int = non_negative(1)

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("eval.tasks: name at least one task")


def packed_path(fmt: str, method: str, root: str | Path = "models/packed") -> Path:
    """The packed weights pack-safetensors writes into the model directory ``<root>/<fmt>/<method>/``."""
    return Path(root) / fmt / method / "model.safetensors"


def run(p: EvalParams, teacher_p: TeacherParams, fmts: list[str], heldout: int, teacher_data: str,
        answers: str | Path = "reports/answers") -> tuple[dict, dict]:
    """``({"models": {name: {format, method, bpp, size_mb, kl, scores, avg}}}, blind baselines)``; per-example
    answers go to ``answers/<name>.parquet``. Everything that can be checked is checked before the first
    model is scored."""
    chosen = [formats.comparison(f, "parameter formats: format") for f in fmts]
    for fmt in chosen:
        check_kernel(p.kernel if fmt.native_kernel else "torch", fmt, p.act_quant)
        for method in METHODS:
            path = packed_path(fmt.name, method)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: packed model not found (run pack-safetensors for {fmt.name})")
    for task in p.tasks:
        family_of(task)
    processor = load_processor(teacher_p.source)
    teacher = load_model(teacher_p.source, dtype_of(teacher_p.dtype))
    tasks = {name: load_task(name, p.n, p.seed, p.sources.get(name)) for name in p.tasks}
    _, held = split_heldout(load_examples(teacher_data, token_ids(teacher.config)), heldout)
    kl = HeldoutKL(teacher, processor, held, p.kl_batch_size, p.max_seq_len)
    models, answers = {}, Path(answers)

    def score(name: str, model, fmt: str, method: str, bpp: float, size_mb: float) -> None:
        console.print(f"eval: {name}")
        result = evaluate(model, processor, tasks, batch_size=p.batch_size, progress=True)
        result.write_examples(answers / f"{name}.parquet")
        models[name] = {"format": fmt, "method": method, "bpp": bpp, "size_mb": size_mb,
                        "kl": 0.0 if method == "teacher" else kl(model),
                        "scores": {t: float(s) for t, s in result.scores.items()}, "avg": float(result.avg)}
        console.print(f"  avg {result.avg:.3f}  " + "  ".join(f"{t} {s:.3f}" for t, s in result.scores.items()))

    teacher_bytes = sum(f.stat().st_size for f in local_dir(teacher_p.source).glob("*.safetensors"))
    score("bf16-teacher", teacher, "bf16", "teacher", 16.0, teacher_bytes / 1e6)
    baselines = {}
    if p.blind_baseline:
        blind = evaluate(teacher, processor, tasks, batch_size=p.batch_size, blank_image=True)
        baselines["bf16-teacher"] = {"scores": {t: float(s) for t, s in blind.scores.items()}, "avg": float(blind.avg)}
    for fmt in chosen:
        for method in METHODS:
            path = packed_path(fmt.name, method)
            meta = read_metadata(path)
            model = load_packed_model(path, act_quant=p.act_quant, kernel=p.kernel if fmt.native_kernel else "torch")
            score(f"{fmt.name}-{method}", model, fmt.name, method, float(meta["bits_per_param_nominal"]),
                  path.stat().st_size / 1e6)
            del model
    return {"models": models}, baselines
