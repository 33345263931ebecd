"""The toy teacher's training loop: fresh procedural data every step, cross-entropy on response tokens.

Deterministic for its seed: the model's initialisation comes from the seed, and the batch of step ``s`` is a
pure function of (seed, s), so the same settings on the same software give the same weights.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.eval.runner import evaluate
from pipeline.eval.tasks import EvalExample
from pipeline.toy.tasks import load_toy
from pipeline.toy import tasks
from pipeline.chat import chat_prompt, plain_prompt
from pipeline.toy.batch import PLAIN_SEPARATOR, encode


@dataclass
class TrainSettings:
    """``params.yaml``: ``toy_teacher.train``."""

    steps: int
    batch_size: int
    lr: float
    final_lr_fraction: float  # cosine decay from lr to lr * this
    warmup_steps: int
    weight_decay: float
    betas: list[float]
    grad_clip: float
    caption_steps: int        # first steps: detailed descriptions only, to learn what the pictures show
    caption_prompt: str
    describe_fraction: float  # share of steps spent on generic requests from the prompt pool
    plain_template: float     # share of generic requests in the plain <|image|>{prompt} template
    describe_format_p: float  # chance of a format instruction (capitals, JSON, ...) in a generic request
    task_weights: dict[str, float]
    eval_every: int           # steps between held-out checks (0: none)
    eval_items: int           # held-out items per task at each check


def learning_rate(s: TrainSettings, step: int) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.final_lr_fraction + (1 - s.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def training_batch(processor, s: TrainSettings, seed: int, step: int) -> tuple[dict[str, torch.Tensor], str]:
    """The batch of ``step``: detailed descriptions during the first ``caption_steps`` (one fixed request,
    so the answer depends on the picture alone and its features are learnt first), then either task
    questions (mixed by ``task_weights``) or generic requests, so that short and long sequences are not
    padded together."""
    rng = random.Random(f"batch/{seed}/{step}")
    first = step * s.batch_size
    if step < s.caption_steps:
        kind = "caption"
        items = [tasks.caption_item(rng, "train", s.caption_prompt) for _ in range(s.batch_size)]
        prompts = [chat_prompt(processor, it.prompt) for it in items]
        responses = [it.response for it in items]
    elif rng.random() < s.describe_fraction:
        kind = "describe"
        items = [tasks.item(tasks.DESCRIBE, seed, first + j, "train", s.describe_format_p) for j in range(s.batch_size)]
        prompts, responses = [], []
        for it in items:
            if rng.random() < s.plain_template:
                prompts.append(plain_prompt(processor, it.prompt))
                responses.append(PLAIN_SEPARATOR + it.response)
            else:
                prompts.append(chat_prompt(processor, it.prompt))
                responses.append(it.response)
    else:
        kind = "qa"
        names = sorted(s.task_weights)
        chosen = rng.choices(names, weights=[s.task_weights[n] for n in names], k=s.batch_size)
        items = [tasks.item(name, seed, first + j, "train") for j, name in enumerate(chosen)]
        prompts = [chat_prompt(processor, it.prompt) for it in items]
        responses = [it.response for it in items]
    return encode(processor, [it.image for it in items], prompts, responses), kind


def _optimizer(model: torch.nn.Module, s: TrainSettings) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=tuple(s.betas))


def train(
    model,
    processor,
    s: TrainSettings,
    seed: int,
    on_step: Callable[[dict], None] | None = None,
    heldout: dict[str, list[EvalExample]] | None = None,
) -> list[dict]:
    """Train ``model`` in place; returns one log row per step (held-out scores on evaluation steps)."""
    unknown = sorted(set(s.task_weights) - set(tasks.TOY_TASKS))
    if unknown:
        raise ValueError(f"train.task_weights: unknown task(s) {unknown}; known: {list(tasks.TOY_TASKS)}")
    for name in ("describe_fraction", "plain_template", "describe_format_p"):
        if not 0.0 <= getattr(s, name) <= 1.0:
            raise ValueError(f"train.{name}: a probability must lie in [0, 1], got {getattr(s, name)}")
    if s.eval_every and heldout is None:
        heldout = {name: load_toy(name, s.eval_items, seed=seed) for name in tasks.TOY_TASKS}
    optimizer = _optimizer(model, s)
    model.train()
    log, t0 = [], time.perf_counter()
    for step in range(s.steps):
        lr = learning_rate(s, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch, kind = training_batch(processor, s, seed, step)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        optimizer.step()
        row = {"step": step + 1, "loss": loss.item(), "kind": kind, "lr": lr, "grad_norm": float(grad_norm),
               "tokens": int((batch["labels"] != -100).sum()), "seconds": round(time.perf_counter() - t0, 2)}
        if s.eval_every and ((step + 1) % s.eval_every == 0 or step + 1 == s.steps):
            result = evaluate(model, processor, heldout, batch_size=64)
            row.update({f"heldout/{k}": v for k, v in result.scores.items()})
            row["heldout/avg"] = result.avg
            model.train()
        log.append(row)
        if on_step is not None:
            on_step(row)
    model.eval()
    return log
