"""The QAT loop: quantisation-aware distillation from the frozen teacher (SPEC section 4).

Student = the teacher's weights in fp32 with every quantised module fake-quantised by the frozen
fitted state; loss = KL(teacher || student) summed over response tokens, divided by the response-token
count of the global batch (all micro-batches, all processes); AdamW (0.9, 0.95), weight decay 0, cosine
schedule without warm-up, lr = lr_scale x 2^-(b + 14) unless set. Runs under ``accelerate`` (one process by
default, DDP on several: ``python -m pipeline.launch``), or with the student sharded by FSDP2
(``launch.strategy: fsdp2``, ``pipeline.qat.distributed``); checkpoints every N steps and resumes from the last
one when the fingerprint matches (the engines and their checkpoints: :mod:`pipeline.qat.engines`). With
``qat.teacher_logits: cache`` the teacher's response-token logits of every training sequence are computed once
before the first step and reused by every step (memory: about vocabulary x 2 bytes per response token);
``forward`` runs the teacher at every step (for large vocabularies: the 11B and SmolLM2 presets).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from pipeline.formats import FormatBase
from pipeline.launch.processes import LaunchParams
from pipeline.launch.processes import settings as launch_settings
from pipeline.models import dtype_of, load_processor, quantised_weight_names, states_by_module
from pipeline.section import bounded, non_negative, positive
from pipeline.qat.api import prepare
from pipeline.qat.distributed import ReshardError
from pipeline.teacher.answers import Example, batch_indices, collate, sequence_lengths
from pipeline.divergence import kl_sum
from pipeline.qat.engines import AccelerateEngine, FSDP2Engine
from pipeline.formats.precision import Precision
from pipeline.qat.modules import learned_scale
from pipeline.recipe import Quantised, quantised_modules
from pipeline.stage import console, progress
from pipeline.teacher.logits import TeacherLogits, head_rows


@dataclass
class QATParams:
    steps: int = positive()
    batch_size: int = positive()                 # sequences per optimizer step, all processes together
    grad_accum: int = positive()
    max_seq_len: int = positive()
    lr: float | None = positive()                # None: lr_scale x 2^-(b + 14), b the average bits per parameter
    lr_scale: float = positive()                 # the multiple of the recipe's rule (its 2,048 steps at 11B)
    betas: list[float] = bounded(ge=0, le=1)
    weight_decay: float = non_negative()
    act_quant: bool
    checkpoint_every: int = positive()
    seed: int
    threads: int = non_negative()                # torch threads (0: its default); the bytes depend on them
    init: Literal["teacher", "ptq"]              # ptq: start from pack.algorithm's direct cast (weights, table, scales)
    learn_scales: bool                           # the bf16 scales as trained parameters (LSQ gradient)
    scale_lr: float = positive()                 # their learning rate (on log2 of the scale); same cosine schedule
    refit_table: bool                            # S3D8: refit each centroid table on the trained weights at the end
    teacher_logits: Literal["cache", "forward"]  # cache: the teacher's response logits once per
    #   training sequence, before the first step (full bf16 rows, exactly what it outputs); forward: per step
    corpus_windows: int = non_negative()         # windows of max_seq_len tokens of each text of corpus_source
    #   trained on beside the answers, every token distilled
    corpus_source: str                           # corpus (the prose corpus' calibration half, never the held-out
    #   half perplexity reads) | english (the shipped English) | file:PATH; several joined by +
    group_by_length: bool                        # batches of sequences of about one length (less padding; as
    #   Hugging Face's TrainingArguments.group_by_length: megabatches of 50 batches sorted by length)

    def __post_init__(self) -> None:
        for part in self.corpus_source.split("+"):
            if part not in ("corpus", "english") and not part.startswith("file:"):
                raise ValueError(f"parameter qat.corpus_source={self.corpus_source!r}: {part!r} is not corpus, "
                                 f"english or file:PATH")


Start = Callable[[str, torch.Tensor], tuple]
"""``start(P, weight) -> (master weight, state, bf16 scale)``: the post-training point (``ptq.start``; the stages read
it from stage direct-cast, ``pipeline.cast.direct.DirectCast.start``)."""


def recipe_lr(bits_per_param: float) -> float:
    return 2.0 ** -(bits_per_param + 14)


def cosine(lr: float, step: int, steps: int) -> float:
    return lr * 0.5 * (1 + math.cos(math.pi * step / steps))


def average_bits(model, fmt: FormatBase) -> float:
    """Bits per parameter of the quantised modules, each in its own format (``fmt`` where a module has none yet; 16
    for one the precision plan keeps unquantised)."""
    sizes = [(getattr(m, "format", fmt if isinstance(m, Quantised) else None), tuple(m.weight.shape), m.weight.numel())
             for _, m in quantised_modules(model)]
    return sum((16.0 if f is None else f.bits_per_param(s)) * n for f, s, n in sizes) / sum(n for *_, n in sizes)


def check(p: QATParams, examples: list[Example], processes: int) -> int:
    """Validate parameters against each other and the data; returns the per-process micro-batch."""
    if p.steps < 1 or p.batch_size < 1 or p.grad_accum < 1 or p.checkpoint_every < 1:
        raise ValueError("parameters qat.steps, qat.batch_size, qat.grad_accum, qat.checkpoint_every must be positive")
    if p.batch_size % (p.grad_accum * processes):
        raise ValueError(f"parameter qat.batch_size={p.batch_size} must be a multiple of qat.grad_accum "
                         f"({p.grad_accum}) x processes ({processes})")
    n_train = len(examples)
    if p.batch_size > n_train:
        raise ValueError(f"parameter qat.batch_size={p.batch_size} exceeds the {n_train} training sequences "
                         f"(raise sample.n_prompts or lower the batch)")
    too_long = [e for e in examples if len(e.prompt_ids) >= p.max_seq_len]
    if too_long:
        longest = max(len(e.prompt_ids) for e in too_long)
        raise ValueError(f"parameter qat.max_seq_len={p.max_seq_len}: {len(too_long)} prompts leave no room for "
                         f"a response (the longest has {longest} tokens); raise it")
    if len(p.betas) != 2:
        raise ValueError(f"parameter qat.betas: expected two values, got {p.betas}")
    return p.batch_size // (p.grad_accum * processes)


def train(fmt: FormatBase, states: dict, teacher_source: str, teacher_dtype: str, examples: list[Example],
          p: QATParams, out_dir: str | Path, checkpoint: str | Path, live_dir: str | Path, fingerprint: str,
          launch: LaunchParams | None = None, start: Start | None = None,
          importance: Callable[[str], torch.Tensor | None] | None = None, plan: Precision | None = None,
          timings: dict | None = None) -> dict:
    """Train and save the student. ``launch``: the launch settings (default: those ``pipeline.launch`` handed
    over, else the ``launch`` section of ``params.yaml``): ``strategy`` ddp runs under ``accelerate`` (DDP
    when several processes), fsdp2 shards the student (``pipeline.qat.distributed``). ``start`` (needed for
    ``qat.init: ptq``) gives each weight's post-training point; ``importance(P)`` the per-input-channel
    weights of the table refit (None: unweighted). ``plan``: the precision plan (each weight's format; default all
    in ``fmt``). ``timings`` gets each step's and checkpoint save's wall seconds (``step_s``, ``checkpoint_s``)."""
    plan = plan or Precision(fmt)
    if p.init == "ptq" and start is None:
        raise ValueError("parameter qat.init=ptq: no post-training start was given")
    from dvclive import Live

    launch = launch if launch is not None else launch_settings()
    engine = (FSDP2Engine if launch.strategy == "fsdp2" else AccelerateEngine)(launch)
    micro = check(p, examples, engine.world)
    torch.manual_seed(p.seed)
    processor = load_processor(teacher_source)
    teacher = engine.teacher(teacher_source, dtype_of(teacher_dtype))
    teacher.requires_grad_(False)
    names: dict[str, str] = {}
    student = engine.student(teacher_source, lambda model: quantise_student(model, plan, states, p, start, names), launch)
    bits = average_bits(student, fmt)
    lr = p.lr if p.lr is not None else p.lr_scale * recipe_lr(bits)
    optimizer = _optimizer(student, p, lr)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    student, optimizer = engine.prepare(student, optimizer)
    main = engine.rank == 0
    checkpoint = engine.checkpoint_path(Path(checkpoint))
    start, history = _resume(engine, checkpoint, student, optimizer, fingerprint, fmt.name)

    live = Live(str(live_dir), resume=False, save_dvc_exp=False, dvcyaml=None) if main else None
    if live:
        for record in history:                      # a resumed run re-logs what the checkpoint holds
            _log(live, record)
    began = time.perf_counter()
    cached = p.teacher_logits == "cache" and start < p.steps
    # batches of batch_size / grad_accum whatever the process count: the same rows on 1 process or N
    source = TeacherLogits(teacher, engine.teacher_dtype, examples if cached else None, processor, p.max_seq_len,
                           p.batch_size // p.grad_accum, engine.device, what="qat: teacher logits")
    lengths = sequence_lengths(examples, p.max_seq_len) if p.group_by_length else None
    with progress() as bar:
        task = bar.add_task(f"qat {fmt.name}", total=p.steps, completed=start)
        timings = {} if timings is None else timings
        timings.update(step_s=[], checkpoint_s=[])
        for step in range(start, p.steps):
            t0 = time.perf_counter()
            for group, base in zip(optimizer.param_groups, base_lrs):
                group["lr"] = cosine(base, step, p.steps)
            picked = batch_indices(len(examples), p.batch_size, step, p.seed, lengths)
            mine = picked[engine.rank::engine.world]
            chunks = [mine[a * micro:(a + 1) * micro] for a in range(p.grad_accum)]
            kl, tokens = _step(engine, student, source, optimizer, chunks, examples, processor, p)
            record = {"step": step + 1, "kl": kl / max(tokens, 1), "lr": cosine(lr, step, p.steps),
                      "tokens": int(tokens)}
            history.append(record)
            if live:
                _log(live, record)
            bar.update(task, completed=step + 1, description=f"qat {fmt.name} kl {record['kl']:.4f}")
            if (step + 1) % p.checkpoint_every == 0 and step + 1 < p.steps:
                t1 = time.perf_counter()
                engine.save(checkpoint, student, optimizer, step + 1, history, fingerprint)
                timings["checkpoint_s"].append(round(time.perf_counter() - t1, 2))
            engine.barrier()
            timings["step_s"].append(round(time.perf_counter() - t0, 2))
    seconds = time.perf_counter() - began
    summary = {}
    refit = engine.save_student(student, processor, out_dir,
                                lambda weights, scales, mods: _quantiser_state(fmt, p, names, weights, scales, mods,
                                                                               importance), fmt.name)
    if main:
        first = history[0]["kl"] if history else float("nan")
        last = sum(r["kl"] for r in history[-10:]) / max(len(history[-10:]), 1)
        summary = {"lr": lr, "bits_per_param": bits, "kl_first": first, "kl_last10": last, "init": p.init,
                   "learn_scales": p.learn_scales, "scale_lr": p.scale_lr if p.learn_scales else None,
                   "refit_table": refit}
        console.print(f"qat-train {fmt.name}: {p.steps - start} steps in {seconds:.0f} s on {engine.world} "
                      f"process(es), {launch.strategy}; {len(timings['checkpoint_s'])} checkpoints in "
                      f"{sum(timings['checkpoint_s']):.0f} s")
        live.end()
    engine.finish(checkpoint)                     # the finished student is the output now
    return summary


def _optimizer(student, p: QATParams, lr: float) -> torch.optim.AdamW:
    """AdamW over the weights at ``lr`` and, with ``qat.learn_scales``, the log2 scales at ``qat.scale_lr``: torch's
    fused kernel (one pass over each tensor's weights, gradients and moments; SmolLM2's 135 M weights on this
    Xeon's 2 cores 0.5 s a step against the loop's 0.9; deterministic, like it)."""
    params = dict(student.named_parameters())
    groups = [{"params": [v for k, v in params.items() if not k.endswith(".qat_log2_scale")], "lr": lr}]
    if p.learn_scales:
        groups.append({"params": [v for k, v in params.items() if k.endswith(".qat_log2_scale")], "lr": p.scale_lr})
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(p.betas), weight_decay=p.weight_decay, fused=True)


def _resume(engine, checkpoint: Path, student, optimizer, fingerprint: str, name: str) -> tuple[int, list]:
    """``(first step, history)`` from the run's checkpoint when it is this run's, else ``(0, [])``."""
    main = engine.rank == 0
    engine.sweep(checkpoint)
    if checkpoint.exists():
        try:
            start, history = engine.load(checkpoint, student, optimizer, fingerprint)
            if main:
                console.print(f"qat-train {name}: resuming at step {start} from {checkpoint}")
            return start, history
        except ValueError as e:
            if isinstance(e, ReshardError):           # another process count's checkpoint: stop, naming it
                raise
            if main:
                console.print(f"qat-train {name}: {e}; starting afresh")
    return 0, []


def _step(engine, student, teacher: TeacherLogits, optimizer, chunks: list, examples: list[Example], processor,
          p: QATParams) -> tuple[float, float]:
    """One optimizer step over this process's micro-batches ``chunks``: ``(KL sum, response tokens)`` of the
    global batch."""
    batches = [collate([examples[i] for i in chunk], processor, p.max_seq_len) for chunk in chunks]
    local_tokens = torch.tensor(float(sum(int(b["loss_mask"].sum()) for b in batches)), device=engine.device)
    global_tokens = engine.reduce_sum(local_tokens).item()
    kl_total = 0.0
    for a, batch in enumerate(batches):
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        t_logits = teacher.rows(batch, chunks[a])
        keep = batch.pop("loss_mask").bool()
        with head_rows(student, keep):            # the head runs on the response rows alone
            kl = kl_sum(student(**batch).logits, t_logits)
        # DDP and FSDP2 average gradients over processes; scale back to a sum over the global batch.
        loss = kl / max(global_tokens, 1) * engine.world
        engine.backward(student, loss, sync=a == len(batches) - 1)
        kl_total += kl.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return engine.reduce_sum(torch.tensor(kl_total, device=engine.device)).item(), global_tokens


def quantise_student(model, plan: Precision | FormatBase, states: dict, p: QATParams, start: Start | None,
              names: dict) -> None:
    """Swap the quantised modules of ``model`` for fake-quantised ones (``prepare``): from the teacher's weights
    with the fitted states, or (``qat.init: ptq``) from the post-training point, whose weights, tables and scales
    replace them; learned scales start at that point's scales or the absmax ones. A model on ``meta`` (FSDP2's
    other ranks) only gets the shapes: rank 0's values arrive by broadcast. ``names`` receives
    ``{module: checkpoint weight name}``. ``plan``: the precision plan, or one format for every module; a module the
    plan keeps unquantised stays as it is."""
    plan = plan if isinstance(plan, Precision) else Precision(plan)
    fmt = plan.default
    of = {m: plan.format_of(saved.removesuffix(".weight")) for m, saved in quantised_weight_names(model).items()}
    mapping = {m: saved for m, saved in quantised_weight_names(model).items() if of[m] is not None}
    names.update(mapping)
    by_module = {m: (st if of[m] is fmt else {}) for m, st in states_by_module(model, states).items() if m in mapping}
    meta = next(model.parameters()).device.type == "meta"
    started, by_weight = {}, {}
    if p.init == "ptq" and not meta:
        with progress() as bar:
            task = bar.add_task(f"qat {fmt.name}: post-training start", total=len(mapping))
            for module_name, saved in mapping.items():
                key = saved.removesuffix(".weight")
                if key not in by_weight:      # tied modules (lm_head and embed_tokens) share one weight: one start
                    weight = model.get_submodule(module_name).weight
                    master, state, scale = start(key, weight.detach())
                    with torch.no_grad():
                        weight.copy_(master.to(weight.dtype))
                    by_weight[key] = (state, scale)
                by_module[module_name], started[module_name] = by_weight[key]
                bar.advance(task)
    scales = None
    if p.learn_scales:
        scales = {n: started[n] if n in started else of[n].absmax_scale(model.get_submodule(n).weight.detach())
                  for n in mapping}
    prepare(model, fmt, by_module, act_quant=p.act_quant, scales=scales, other={m: of[m] for m in mapping})


def _quantiser_state(fmt: FormatBase, p: QATParams, names: dict, weights: dict, scales: dict, modules: dict,
                     importance) -> tuple[dict, dict | None]:
    """The tensors of ``engines.QAT_STATE`` (keyed by checkpoint names) and, with ``qat.refit_table`` (S3D8), a summary of
    the refit: each table refitted by weighted k-means on the trained weights over their scales, kept where it
    lowers the (importance-weighted) reconstruction error."""
    tensors, refit = {}, None
    if p.refit_table and fmt.refits_state:
        refit = {"matrices": 0, "improved": 0, "error_before": 0.0, "error_after": 0.0}
    for module, m in modules.items():
        fmt = m.format                                 # the precision plan's format of this module
        key = names[module].removesuffix(".weight")
        w = weights[module].detach().float().cpu()
        state = {k: v.detach().cpu() for k, v in m.qstate.items()}
        scale = learned_scale(scales[module].cpu()) if module in scales else None
        if refit is not None and fmt.refits_state:
            h = importance(key) if importance is not None else None
            h = torch.ones(w.shape[1]) if h is None else h.float()
            s = scale if scale is not None else fmt.absmax_scale(w)
            expanded = fmt.expand_scale(s.float(), w.shape)
            err = lambda st: float((((w - fmt.values_at_scale(w, st, s) * expanded) ** 2) * h).double().sum())  # noqa: E731
            new = fmt.refit_state(w, s, h, state)
            before, after = err(state), err(new)
            refit["matrices"] += 1
            refit["error_before"] += before
            if after < before:
                state, refit["improved"] = new, refit["improved"] + 1
            refit["error_after"] += min(before, after)
        for k, v in state.items():
            tensors[f"{key}.{k}"] = v.contiguous()
        if scale is not None:
            tensors[f"{key}.scale"] = scale.contiguous()
    return tensors, refit


def _log(live, record: dict) -> None:
    live.step = record["step"]
    for key in ("kl", "lr", "tokens"):
        live.log_metric(f"train/{key}", record[key])
    live.next_step()


