"""The QAT loop: quantisation-aware distillation from the frozen teacher (SPEC section 4).

Student = the teacher's weights in fp32 with every quantised module fake-quantised by the frozen
fitted state; loss = KL(teacher || student) summed over response tokens, divided by the response-token
count of the global batch (all micro-batches, all processes); AdamW (0.9, 0.95), weight decay 0, cosine
schedule without warm-up, lr = 2^-(b + 14) unless set. Runs under ``accelerate`` (one process by
default); checkpoints every N steps and resumes from the last one when the fingerprint matches.

Checkpoints hold no pickle: tensors (model, optimizer moments) in safetensors, everything else (step, history,
optimizer hyper-parameters, fingerprint) in its JSON metadata. A checkpoint that cannot be read, or that was
written for other parameters or data, is reported and training starts afresh.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.checkpoint import write_tensors
from pipeline.formats import FormatBase
from pipeline.io import atomic_dir
from pipeline.models import dtype_of, load_model, load_processor, states_by_module
from pipeline.params import bounded, non_negative, positive
from pipeline.qat.api import prepare
from pipeline.qat.data import Example, batch_indices, collate
from pipeline.qat.loss import response_kl_sum
from pipeline.recipe import quantised_modules
from pipeline.stage import console, progress


@dataclass
class QATParams:
    steps: int = positive(400)
    batch_size: int = positive(16)        # sequences per optimizer step, all processes together
    grad_accum: int = positive(1)
    max_seq_len: int = positive(160)
    lr: float | None = positive(None)     # None: 2^-(b + 14), b the average bits per parameter
    betas: list[float] = bounded(default_factory=lambda: [0.9, 0.95], ge=0, le=1)
    weight_decay: float = non_negative(0.0)
    act_quant: bool = True
    checkpoint_every: int = positive(25)
    seed: int = 0
    threads: int = non_negative(1)


def recipe_lr(bits_per_param: float) -> float:
    return 2.0 ** -(bits_per_param + 14)


def cosine(lr: float, step: int, steps: int) -> float:
    return lr * 0.5 * (1 + math.cos(math.pi * step / steps))


def average_bits(model, fmt: FormatBase) -> float:
    sizes = [(tuple(m.weight.shape), m.weight.numel()) for _, m in quantised_modules(model)]
    return sum(fmt.bits_per_param(s) * n for s, n in sizes) / sum(n for _, n in sizes)


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
          p: QATParams, out_dir: str | Path, checkpoint: str | Path, live_dir: str | Path, fingerprint: str) -> dict:
    from accelerate import Accelerator
    from dvclive import Live

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    micro = check(p, examples, accelerator.num_processes)
    torch.manual_seed(p.seed)
    processor = load_processor(teacher_source)
    teacher = load_model(teacher_source, dtype_of(teacher_dtype)).to(accelerator.device)
    teacher.requires_grad_(False)
    student = load_model(teacher_source, torch.float32)
    prepare(student, fmt, states_by_module(student, states), act_quant=p.act_quant)
    student.train()
    bits = average_bits(student, fmt)
    lr = p.lr if p.lr is not None else recipe_lr(bits)
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, betas=tuple(p.betas), weight_decay=p.weight_decay)
    student, optimizer = accelerator.prepare(student, optimizer)

    start, history = 0, []
    checkpoint = Path(checkpoint)
    if checkpoint.exists():
        try:
            start, history = _load_checkpoint(checkpoint, accelerator.unwrap_model(student), optimizer, fingerprint)
            if accelerator.is_main_process:
                console.print(f"qat-train {fmt.name}: resuming at step {start} from {checkpoint}")
        except ValueError as e:
            if accelerator.is_main_process:
                console.print(f"qat-train {fmt.name}: {e}; starting afresh")

    live = Live(str(live_dir), resume=False, save_dvc_exp=False, dvcyaml=None) if accelerator.is_main_process else None
    if live:
        for record in history:                      # a resumed run re-logs what the checkpoint holds
            _log(live, record)
    began = time.perf_counter()
    with progress() as bar:
        task = bar.add_task(f"qat {fmt.name}", total=p.steps, completed=start)
        for step in range(start, p.steps):
            step_lr = cosine(lr, step, p.steps)
            for group in optimizer.param_groups:
                group["lr"] = step_lr
            picked = batch_indices(len(examples), p.batch_size, step, p.seed)
            mine = picked[accelerator.process_index::accelerator.num_processes]
            batches = [collate([examples[i] for i in mine[a * micro:(a + 1) * micro]], processor, p.max_seq_len)
                       for a in range(p.grad_accum)]
            local_tokens = torch.tensor(float(sum(int(b["loss_mask"].sum()) for b in batches)), device=accelerator.device)
            global_tokens = accelerator.reduce(local_tokens, "sum").item()
            kl_total = 0.0
            for a, batch in enumerate(batches):
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                mask = batch.pop("loss_mask")
                with torch.no_grad():
                    t_logits = teacher(**{**batch, "pixel_values": batch["pixel_values"].to(teacher.dtype)}).logits
                s_logits = student(**batch).logits
                kl = response_kl_sum(s_logits, t_logits, mask)
                # DDP averages gradients over processes; scale back to a sum over the global batch.
                loss = kl / max(global_tokens, 1) * accelerator.num_processes
                sync = a == len(batches) - 1
                if sync:
                    accelerator.backward(loss)
                else:
                    with accelerator.no_sync(student):
                        accelerator.backward(loss)
                kl_total += kl.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            kl_sum = accelerator.reduce(torch.tensor(kl_total, device=accelerator.device), "sum").item()
            record = {"step": step + 1, "kl": kl_sum / max(global_tokens, 1), "lr": step_lr,
                      "tokens": int(global_tokens)}
            history.append(record)
            if live:
                _log(live, record)
            bar.update(task, completed=step + 1, description=f"qat {fmt.name} kl {record['kl']:.4f}")
            if (step + 1) % p.checkpoint_every == 0 and step + 1 < p.steps and accelerator.is_main_process:
                _save_checkpoint(checkpoint, accelerator.unwrap_model(student), optimizer, step + 1, history, fingerprint)
            accelerator.wait_for_everyone()
    seconds = time.perf_counter() - began
    summary = {}
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(student)
        _save_student(model, processor, out_dir)
        first = history[0]["kl"] if history else float("nan")
        last = sum(r["kl"] for r in history[-10:]) / max(len(history[-10:]), 1)
        summary = {"lr": lr, "bits_per_param": bits, "kl_first": first, "kl_last10": last}
        console.print(f"qat-train {fmt.name}: {p.steps - start} steps in {seconds:.0f} s")
        live.end()
        checkpoint.unlink(missing_ok=True)       # the finished student is the output now
    return summary


def _log(live, record: dict) -> None:
    live.step = record["step"]
    for key in ("kl", "lr", "tokens"):
        live.log_metric(f"train/{key}", record[key])
    live.next_step()


def _save_checkpoint(path: Path, model, optimizer, step: int, history: list, fingerprint: str) -> None:
    """Model and optimizer tensors as safetensors; step, history and optimizer settings as JSON metadata."""
    names = {id(p): n for n, p in model.named_parameters()}
    opt = optimizer.state_dict()
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    for index, state in opt["state"].items():
        for key, value in state.items():
            tensors[f"optim.{ordered[index]}.{key}"] = value.detach().reshape(value.shape).contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    write_tensors(path, tensors, {"step": str(step), "history": json.dumps(history), "fingerprint": fingerprint,
                                  "param_groups": json.dumps(groups), "param_order": json.dumps(ordered)})


def _load_checkpoint(path: Path, model, optimizer, fingerprint: str) -> tuple[int, list]:
    """Restore a checkpoint of this run; ``ValueError`` (the caller starts afresh) if it is unreadable,
    foreign or from other parameters or data. Never unpickles anything."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("fingerprint") != fingerprint:
                raise ValueError(f"{path} is from other parameters or data")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        step, history = int(meta["step"]), json.loads(meta["history"])
        groups, ordered = json.loads(meta["param_groups"]), json.loads(meta["param_order"])
    except ValueError:
        raise
    except Exception as e:  # truncated, not safetensors, missing metadata
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from None
    current = [n for n, _ in model.named_parameters()]
    by_name = dict(model.named_parameters())
    if sorted(ordered) != sorted(current) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{path} was written for another model")
    model.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")})
    state = {}
    for index, name in enumerate(ordered):
        entry = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith(f"optim.{name}.")
                 and "." not in k[len(f"optim.{name}."):]}
        if entry:
            state[index] = entry
    ids = [id(p) for group in optimizer.param_groups for p in group["params"]]
    if [id(by_name[n]) for n in ordered] != ids:
        raise ValueError(f"{path}: parameter order differs from this run's optimizer")
    param_groups = []
    start = 0
    for saved, group in zip(groups, optimizer.param_groups):
        count = len(group["params"])
        param_groups.append({**saved, "params": list(range(start, start + count))})
        start += count
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    return step, history


def _save_student(model, processor, out_dir: str | Path) -> None:
    """The fp32 master weights, as a Hugging Face model directory (the pack stage reads it)."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
