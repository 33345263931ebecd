"""The evaluation of a compression run: the bf16 teacher and, for every format, its direct-cast and QAT
models loaded from their packed files, each scored on the tasks and measured by KL to the teacher."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import torch

from pipeline import formats
from pipeline.eval.kl import HeldoutKL
from pipeline.eval.runner import evaluate
from pipeline.eval.tasks import family_of, load_task
from pipeline.models import dtype_of, load_model, load_processor, token_ids
from pipeline.packed import DECODES, check_kernel, load_packed_model, read_metadata
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
    decode: str = "eager"      # "lazy": packed weights stay packed in memory, decoded per forward (the 11B's)
    threads: int = non_negative(1)

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("eval.tasks: name at least one task")
        if self.decode not in DECODES:
            raise ValueError(f"eval.decode: {self.decode!r} is not one of {', '.join(DECODES)}")


def packed_path(fmt: str, method: str, root: str | Path = "models/packed") -> Path:
    """The packed weights pack-safetensors writes into the model directory ``<root>/<fmt>/<method>/``."""
    return Path(root) / fmt / method / "model.safetensors"


@dataclass
class _Job:
    name: str
    fmt: str
    method: str              # "teacher", "blind" (the teacher on blank images) or one of METHODS


def _jobs(fmts: list[str], blind: bool) -> list[_Job]:
    jobs = [_Job("bf16-teacher", "bf16", "teacher")] + ([_Job("bf16-teacher", "bf16", "blind")] if blind else [])
    return jobs + [_Job(f"{f}-{m}", f, m) for f in fmts for m in METHODS]


def run(p: EvalParams, teacher_p: TeacherParams, fmts: list[str], heldout: int,
        teacher_data: str) -> tuple[dict, dict, dict[str, pa.Table]]:
    """``({"models": {name: {format, method, bpp, size_mb, kl, scores, avg}}, "scores_cleaned": {name:
    {task: score}}}, blind baselines, answers)``, ``answers`` one table of per-example answers per model.
    ``scores`` are lmms-eval's scoring of each generation; ``scores_cleaned`` the cleaned-up variant beside
    them (``tasks.score_cleaned``), never instead. Everything that can be checked is checked before
    the first model is scored.

    Under a launcher (``launch.num_processes`` > 1) the models are dealt round-robin to the ranks (each rank
    holds the teacher, for the KL) and every rank returns the whole result, gathered in the one-process
    order; each model is scored exactly as on one process. Models run on the rank's GPU when there is one
    (``eval.kernel: native`` is the CPU's)."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    state = PartialState(cpu=not torch.cuda.is_available())
    device = state.device
    chosen = [formats.comparison(f, "parameter formats: format") for f in fmts]
    if p.kernel == "native" and device.type != "cpu":
        raise ValueError(f"parameter eval.kernel=native: the native kernels run on the CPU; this rank runs on "
                         f"{device} (use eval.kernel=torch)")
    for fmt in chosen:
        check_kernel(p.kernel if fmt.native_kernel else "torch", fmt, p.act_quant)
        for method in METHODS:
            path = packed_path(fmt.name, method)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: packed model not found (run pack-safetensors for {fmt.name})")
    for task in p.tasks:
        family_of(task)
    processor = load_processor(teacher_p.source)
    teacher = load_model(teacher_p.source, dtype_of(teacher_p.dtype)).to(device)
    tasks = {name: load_task(name, p.n, p.seed, p.sources.get(name)) for name in p.tasks}
    _, held = split_heldout(load_examples(teacher_data, token_ids(teacher.config)), heldout)
    kl = HeldoutKL(teacher, processor, held, p.kl_batch_size, p.max_seq_len)
    teacher_bytes = sum(f.stat().st_size for f in local_dir(teacher_p.source).glob("*.safetensors"))
    jobs = _jobs([f.name for f in chosen], p.blind_baseline)
    done = []
    for job in jobs[state.process_index::state.num_processes]:
        console.print(f"eval: {job.name}" + (" (blank images)" if job.method == "blind" else "")
                      + (f" on rank {state.process_index}" if state.num_processes > 1 else ""))
        if job.method in ("teacher", "blind"):
            model, bpp, size_mb = teacher, 16.0, teacher_bytes / 1e6
        else:
            fmt = formats.get(job.fmt)
            path = packed_path(job.fmt, job.method)
            bpp, size_mb = float(read_metadata(path)["bits_per_param_nominal"]), path.stat().st_size / 1e6
            model = load_packed_model(path, act_quant=p.act_quant, kernel=p.kernel if fmt.native_kernel else "torch",
                                      decode=p.decode).to(device)
        result = evaluate(model, processor, tasks, batch_size=p.batch_size, progress=job.method != "blind",
                          blank_image=job.method == "blind")
        scores = {t: float(s) for t, s in result.scores.items()}
        if job.method == "blind":
            done.append((job, {"scores": scores, "avg": float(result.avg)}, None, None))
            continue
        record = {"format": job.fmt, "method": job.method, "bpp": bpp, "size_mb": size_mb,
                  "kl": 0.0 if job.method == "teacher" else kl(model), "scores": scores, "avg": float(result.avg)}
        console.print(f"  avg {result.avg:.3f}  " + "  ".join(f"{t} {s:.3f}" for t, s in scores.items()))
        done.append((job, record, result.examples, {t: float(s) for t, s in result.scores_cleaned.items()}))
        del model
    if state.num_processes > 1:
        done = gather_object(done)
    order = {(j.name, j.method): i for i, j in enumerate(jobs)}
    models, cleaned, baselines, answers = {}, {}, {}, {}
    for job, record, examples, scores_cleaned in sorted(done, key=lambda d: order[(d[0].name, d[0].method)]):
        if job.method == "blind":
            baselines[job.name] = record
        else:
            models[job.name], cleaned[job.name], answers[job.name] = record, scores_cleaned, examples
    return {"models": models, "scores_cleaned": cleaned}, baselines, answers
