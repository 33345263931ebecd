"""DVC stage eval: score the bf16 teacher and every direct-cast and QAT model, loaded from packed files.

    python stages/eval.py

Writes ``reports/eval.json`` (per model: format, method, bpp, size_mb, kl, scores per task, avg),
``reports/summary.md`` (the paper's table with our numbers), ``reports/eval_plot.png`` (score vs bits
per parameter) and per-example answers in ``reports/answers/<model>.parquet``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline import formats, params
from pipeline.eval.runner import evaluate
from pipeline.eval.tasks import load_task
from pipeline.io import write_json, write_text
from pipeline.models import dtype_of, load_model, load_processor
from pipeline.packed import load_packed_model, read_metadata
from pipeline.qat.data import collate, load_examples, split_heldout
from pipeline.qat.loss import response_kl_sum
from pipeline.report import plot_scores, summary_markdown
from pipeline.stage import console, set_threads, stage_errors, versions
from pipeline.teacher import TeacherParams, local_dir

TOY_TASKS = ["toy-vqa", "toy-chartqa", "toy-docvqa", "toy-ai2d"]


@dataclass
class EvalParams:
    tasks: list[str] = field(default_factory=lambda: list(TOY_TASKS))
    n: int = 256
    seed: int = 0
    batch_size: int = 32
    act_quant: bool = True
    kl_batch_size: int = 16
    max_seq_len: int = 192
    sources: dict[str, str] = field(default_factory=dict)
    blind_baseline: bool = True
    kernel: str = "torch"      # "native": S3D8 models run on the native kernels (packed bytes, int32 dots)
    threads: int | None = None


class HeldoutKL:
    """KL(teacher || model) per response token on held-out teacher answers; teacher logits computed once."""

    def __init__(self, teacher, processor, examples, p: EvalParams) -> None:
        self.batches = [collate(examples[i:i + p.kl_batch_size], processor, p.max_seq_len)
                        for i in range(0, len(examples), p.kl_batch_size)]
        self.teacher_logits = [self._logits(teacher, b) for b in self.batches]

    @torch.inference_mode()
    def _logits(self, model, batch) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        return model(**inputs).logits.float()

    def __call__(self, model) -> float:
        if not self.batches:
            return float("nan")
        total = tokens = 0.0
        for batch, t_logits in zip(self.batches, self.teacher_logits):
            total += response_kl_sum(self._logits(model, batch), t_logits, batch["loss_mask"]).item()
            tokens += int(batch["loss_mask"].sum())
        return total / tokens


def run(p: EvalParams, teacher_p: TeacherParams, fmts: list[str], heldout: int, teacher_data: str) -> dict:
    unknown = [f for f in fmts if f not in formats.QUANTISED]
    if unknown:
        raise ValueError(f"parameter formats: {unknown} are not quantised formats ({', '.join(formats.QUANTISED)})")
    processor = load_processor(teacher_p.source)
    teacher = load_model(teacher_p.source, dtype_of(teacher_p.dtype))
    tasks = {name: load_task(name, p.n, p.seed, p.sources.get(name)) for name in p.tasks}
    _, held = split_heldout(load_examples(teacher_data), heldout)
    kl = HeldoutKL(teacher, processor, held, p)
    models, answers = {}, Path("reports/answers")

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
    for fmt in fmts:
        for method in ("direct-cast", "qat"):
            path = Path(f"models/packed/{fmt}/{method}.safetensors")
            if not path.exists():
                raise FileNotFoundError(f"{path}: packed model not found (run pack-safetensors for {fmt})")
            meta = read_metadata(path)
            model = load_packed_model(path, act_quant=p.act_quant, kernel=p.kernel if fmt == "s3d8" else "torch")
            score(f"{fmt}-{method}", model, fmt, method, float(meta["bits_per_param_nominal"]),
                  path.stat().st_size / 1e6)
            del model
    return {"models": models}, baselines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--teacher-data", default="data/teacher")
    args = parser.parse_args(argv)
    with stage_errors("eval"):
        p = params.load(EvalParams, "eval", args.params)
        teacher = params.load(TeacherParams, "teacher", args.params)
        doc = params.load_yaml(args.params)
        set_threads(p.threads)
        result, baselines = run(p, teacher, list(doc.get("formats", [])), int(doc.get("heldout_prompts", 0)),
                                args.teacher_data)
        write_json("reports/eval.json", result)
        write_json("reports/eval_baselines.json", {"blind": baselines, "params": p.__dict__, **versions()})
        write_text("reports/summary.md", summary_markdown(result, p.tasks, baselines, teacher.name))
        plot_scores(result, "reports/eval_plot.png")
        console.print("[green]eval[/] wrote reports/eval.json, reports/summary.md, reports/eval_plot.png")


if __name__ == "__main__":
    main()
