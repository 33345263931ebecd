"""The evaluation of a compression run: the bf16 teacher and, for every format, its direct-cast and QAT
models loaded from their packed files, each scored on the tasks and measured by KL to the teacher."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch

from pipeline import formats
from pipeline.launch import ranks
from pipeline.chat import is_text_only
from pipeline.eval.kl import HeldoutKL
from pipeline.eval.runner import evaluate
from pipeline.eval.tasks import family_of, load_task
from pipeline.launch.processes import settings as launch_settings
from pipeline.models import dtype_of, load_model, load_processor, token_ids
from pipeline.packed.file import load_packed_model, read_metadata
from pipeline.packed.modules import DECODES, check_kernel
from pipeline.section import non_negative, positive
from pipeline.teacher.answers import load_examples, split_heldout
from pipeline.recipe import STUDENTS
from pipeline.stage import console
from pipeline.teacher.source import TeacherParams, local_dir, teacher_bytes


@dataclass
class EvalParams:
    tasks: list[str]
    n: int = positive()
    seed: int
    batch_size: int = positive()
    act_quant: bool
    kl_batch_size: int = positive()
    max_seq_len: int = positive()
    sources: dict[str, str]
    blind_baseline: bool
    kernel: str                          # "native": formats with a native kernel run on it (packed bytes, int32 dots)
    decode: str                          # "lazy": packed weights stay packed in memory, decoded per forward (the 11B's)
    threads: int = non_negative()
    perplexity_tokens: int = positive()  # text-only teachers: held-out corpus tokens perplexity is measured on
    perplexity_window: int = positive()  # ... in windows of this many tokens
    sample_tokens: int = positive()      # ... greedy tokens of the generation sample per model

    def __post_init__(self) -> None:
        if self.decode not in DECODES:
            raise ValueError(f"eval.decode: {self.decode!r} is not one of {', '.join(DECODES)}")


def packed_path(fmt: str, method: str, root: str | Path = "models/packed") -> Path:
    """The packed weights pack-safetensors writes into the model directory ``<root>/<fmt>/<method>/``."""
    return Path(root) / fmt / method / "model.safetensors"


@dataclass
class _Job:
    name: str
    fmt: str
    method: str              # "teacher", "blind" (the teacher on blank images) or one of STUDENTS


def _jobs(fmts: list[str], blind: bool) -> list[_Job]:
    bf16 = formats.BF16_BASELINE
    jobs = [_Job(f"{bf16}-teacher", bf16, "teacher")] + ([_Job(f"{bf16}-teacher", bf16, "blind")] if blind else [])
    return jobs + [_Job(f"{f}-{m}", f, m) for f in fmts for m in STUDENTS]


def _model_of(job: _Job, p: EvalParams, teacher, teacher_size: int, device):
    """``(model, bpp, size_mb)`` of a job: the teacher itself, or a packed model loaded as ``p`` says."""
    if job.method in ("teacher", "blind"):
        return teacher, 16.0, teacher_size / 1e6
    fmt = formats.get(job.fmt)
    path = packed_path(job.fmt, job.method)
    bpp, size_mb = float(read_metadata(path)["bits_per_param_nominal"]), path.stat().st_size / 1e6
    model = load_packed_model(path, act_quant=p.act_quant, kernel=p.kernel if fmt.native_kernel else "torch",
                              decode=p.decode).to(device)
    return model, bpp, size_mb


def run(p: EvalParams, teacher_p: TeacherParams, fmts: list[str], heldout: int,
        teacher_data: str) -> tuple[dict, dict, dict[str, pa.Table]] | None:
    """``({"models": {name: {format, method, bpp, size_mb, kl, scores, avg}}, "scores_cleaned": {name:
    {task: score}}}, blind baselines, answers)``, ``answers`` one table of per-example answers per model.
    ``scores`` are lmms-eval's scoring of each generation; ``scores_cleaned`` the cleaned-up variant beside
    them (``tasks.score_cleaned``), never instead. Everything that can be checked is checked before
    the first model is scored.

    Under a launcher (``launch.num_processes`` > 1) the models are dealt round-robin to the ranks (each rank
    holds the teacher, for the KL); rank 0 returns the whole result, gathered in the one-process order, the
    others None as soon as their models are scored (``pipeline.launch.ranks.collect``: no rank waits in a collective
    for another's model). Each model is scored exactly as on one process. Models run on the rank's GPU when
    there is one (``eval.kernel: native`` is the CPU's)."""
    from accelerate import PartialState

    ranks.init_process_group(launch_settings())
    state = PartialState(cpu=not torch.cuda.is_available())
    device = state.device
    chosen = [formats.comparison(f, "parameter formats: format") for f in fmts]
    if p.kernel == "native" and device.type != "cpu":
        raise ValueError(f"parameter eval.kernel=native: the native kernels run on the CPU; this rank runs on "
                         f"{device} (use eval.kernel=torch)")
    for fmt in chosen:
        check_kernel(p.kernel if fmt.native_kernel else "torch", fmt, p.act_quant)
        for method in STUDENTS:
            path = packed_path(fmt.name, method)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: packed model not found (run pack-safetensors for {fmt.name})")
    teacher_dir = str(local_dir(teacher_p.dir))            # resolved once (a hub id: its cached snapshot)
    teacher_size = teacher_bytes(teacher_dir)
    processor = load_processor(teacher_dir)
    if is_text_only(processor):
        return _run_text(p, teacher_p, teacher_dir, teacher_size, chosen, heldout, teacher_data, processor, state)
    if not p.tasks:
        raise ValueError("eval.tasks: name at least one task")
    for task in p.tasks:
        family_of(task)
    teacher = load_model(teacher_dir, dtype_of(teacher_p.dtype)).to(device)
    tasks = {name: load_task(name, p.n, p.seed, p.sources.get(name)) for name in p.tasks}
    _, held = split_heldout(load_examples(teacher_data, token_ids(teacher.config)), heldout)
    kl = HeldoutKL(teacher, processor, held, p.kl_batch_size, p.max_seq_len)
    jobs = _jobs([f.name for f in chosen], p.blind_baseline)
    done = []
    for job in jobs[state.process_index::state.num_processes]:
        console.print(f"eval: {job.name}" + (" (blank images)" if job.method == "blind" else "")
                      + (f" on rank {state.process_index}" if state.num_processes > 1 else ""))
        model, bpp, size_mb = _model_of(job, p, teacher, teacher_size, device)
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
    gathered = ranks.collect("eval", done)
    if gathered is None:
        return None
    done = [d for part in gathered for d in part]
    order = {(j.name, j.method): i for i, j in enumerate(jobs)}
    models, cleaned, baselines, answers = {}, {}, {}, {}
    for job, record, examples, scores_cleaned in sorted(done, key=lambda d: order[(d[0].name, d[0].method)]):
        if job.method == "blind":
            baselines[job.name] = record
        else:
            models[job.name], cleaned[job.name], answers[job.name] = record, scores_cleaned, examples
    return {"models": models, "scores_cleaned": cleaned}, baselines, answers


def _run_text(p: EvalParams, teacher_p: TeacherParams, teacher_dir: str, teacher_size: int, chosen: list, heldout: int,
              teacher_data: str, tokenizer, state) -> tuple[dict, dict, dict[str, pa.Table]]:
    """A text-only teacher: per model KL to the teacher and top-1 agreement on the held-out teacher answers,
    perplexity on the held-out corpus (:mod:`pipeline.eval.text`), and a greedy generation sample for the first
    held-out prompt. ``({"models": {name: {format, method, bpp, size_mb, kl, top1_agreement, perplexity}}},
    {}, {name: sample table})``. One process scores every model (a 135M model takes seconds per model)."""
    from pipeline.eval.text import TextReference, hf_logits_fn
    from pipeline.texts import corpus_windows

    if state.num_processes > 1:
        raise ValueError("eval of a text-only teacher runs on one process: set launch.num_processes=1")
    device = state.device
    teacher = load_model(teacher_dir, dtype_of(teacher_p.dtype)).to(device)
    _, held = split_heldout(load_examples(teacher_data, token_ids(teacher.config)), heldout)
    console.print(f"eval: the teacher's side ({len(held)} held-out answers, {p.perplexity_tokens} corpus tokens)")
    reference = TextReference.build(teacher, tokenizer, held, corpus_windows(tokenizer, p.perplexity_tokens,
                                                                             p.perplexity_window), p.max_seq_len)
    prompt = torch.tensor([list(held[0].prompt_ids)])
    models, answers = {}, {}
    for job in _jobs([f.name for f in chosen], blind=False):
        console.print(f"eval: {job.name}")
        model, bpp, size_mb = _model_of(job, p, teacher, teacher_size, device)
        scores = reference.score(hf_logits_fn(model))
        with torch.inference_mode():
            out = model.generate(input_ids=prompt.to(device), attention_mask=torch.ones_like(prompt).to(device),
                                 do_sample=False, max_new_tokens=p.sample_tokens,
                                 pad_token_id=tokenizer.pad_token_id)[0, prompt.shape[1]:].tolist()
        models[job.name] = {"format": job.fmt, "method": job.method, "bpp": bpp, "size_mb": size_mb,
                            "kl": 0.0 if job.method == "teacher" else scores["kl"],
                            "top1_agreement": scores["top1_agreement"], "perplexity": scores["perplexity"]}
        answers[job.name] = pa.Table.from_pylist([{
            "index": held[0].index, "prompt": tokenizer.decode(list(held[0].prompt_ids)),
            "response": tokenizer.decode(out, skip_special_tokens=True), "response_ids": out,
            "teacher_response": tokenizer.decode(list(held[0].response_ids), skip_special_tokens=True)}])
        console.print(f"  KL {models[job.name]['kl']:.4f}  top-1 {scores['top1_agreement']:.3f}  "
                      f"perplexity {scores['perplexity']:.2f}")
        del model
    return {"models": models}, {}, answers
