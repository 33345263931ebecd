"""QAT throughput: tokens per second of a qat-train step and its cost against a plain fine-tuning step.

One step of the default config (params.yaml: qat.batch_size sequences, the toy teacher, the teacher answers in
data/teacher, the fitted state in data/centroids, the GPTQ start from data/calibration), split into collate,
teacher logits (a bf16 forward per step, or the gather from the once-computed cache), student forward (fake
quantised weights and activations), KL, backward and optimizer; the plain step runs the same batch through the
unquantised fp32 student. Per thread count, medians over the timed steps. Usage (after the upstream stages):

    .venv/bin/python benchmarks/qat_throughput.py [--format s3d8] [--threads 1 2] [--steps 8]

Writes reports/qat_throughput.json and reports/qat_throughput.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

import pipeline.toy  # noqa: F401  (the toy image pool of the teacher answers)
from pipeline import formats, params, ptq
from pipeline.calibrate import CALIBRATION, Calibration
from pipeline.fit import check_states
from pipeline.io import write_json, write_text
from pipeline.models import dtype_of, load_config, load_model, load_processor, token_ids
from pipeline.qat.data import batch_indices, collate, load_examples, split_heldout
from pipeline.qat.loss import kl_sum
from pipeline.qat.train import QATParams, _quantise, _teacher_forward, teacher_logits
from pipeline.teacher import TeacherParams

PARTS = ["collate", "teacher forward", "teacher cache gather", "student forward", "kl", "backward", "optimizer"]
PLAIN = ["plain forward", "plain kl", "plain backward", "plain optimizer"]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((l.split(":", 1)[1].split() for l in text.splitlines() if l.startswith("flags")), [])
    return sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"})


def measure(fmt_name: str, threads: int, steps: int, params_path: str) -> dict:
    torch.set_num_threads(threads)
    p = params.load(QATParams, "qat", params_path)
    teacher_p = params.load(TeacherParams, "teacher", params_path)
    heldout = params.read(params_path)["heldout_prompts"]
    fmt = formats.comparison(fmt_name, "--format")
    state_file = Path(f"data/centroids/{fmt.name}.safetensors")
    states = check_states(fmt, fmt.load_states(state_file), state_file)
    train_set, _ = split_heldout(load_examples("data/teacher", token_ids(load_config(teacher_p.source))), heldout)
    calibration = Calibration(CALIBRATION if Path(CALIBRATION).exists() else None)
    start = lambda name, w: ptq.start(fmt.name, w, method="gptq", hessian=calibration.get(name))  # noqa: E731
    processor = load_processor(teacher_p.source)
    dtype = dtype_of(teacher_p.dtype)
    teacher = load_model(teacher_p.source, dtype).requires_grad_(False)
    t0 = time.perf_counter()
    cache = teacher_logits(teacher, train_set, processor, p.max_seq_len, p.batch_size, "cpu", dtype)
    cache_s = time.perf_counter() - t0
    cache_bytes = sum(c.numel() * c.element_size() for c in cache)
    student = load_model(teacher_p.source, torch.float32)
    t0 = time.perf_counter()
    _quantise(student, fmt, states, p, start if calibration.path else None, {})
    start_s = time.perf_counter() - t0
    plain = load_model(teacher_p.source, torch.float32)
    student.train(), plain.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-5, betas=(0.9, 0.95)) for m in (student, plain)]
    rows, tokens, padded = [], [], []
    for step in range(steps + 1):                   # step 0 warms up
        times = {}
        last = time.perf_counter()

        def tick(name):
            nonlocal last
            now = time.perf_counter()
            times[name] = now - last
            last = now

        picked = batch_indices(len(train_set), p.batch_size, step, p.seed)
        batch = collate([train_set[i] for i in picked], processor, p.max_seq_len)
        keep = batch.pop("loss_mask").bool()
        tick("collate")
        with torch.no_grad():
            t_rows = _teacher_forward(teacher, batch, dtype)[keep]
        tick("teacher forward")
        cached = torch.cat([cache[i] for i in picked])
        tick("teacher cache gather")
        s = student(**batch).logits[keep]
        tick("student forward")
        kl = kl_sum(s, cached)
        tick("kl")
        kl.backward()
        tick("backward")
        opts[0].step(), opts[0].zero_grad(set_to_none=True)
        tick("optimizer")
        s = plain(**batch).logits[keep]
        tick("plain forward")
        kl = kl_sum(s, t_rows)
        tick("plain kl")
        kl.backward()
        tick("plain backward")
        opts[1].step(), opts[1].zero_grad(set_to_none=True)
        tick("plain optimizer")
        if step:
            rows.append(times)
            tokens.append(int(batch["attention_mask"].sum()))
            padded.append(batch["input_ids"].numel())
    med = {k: statistics.median(r[k] for r in rows) for k in PARTS + PLAIN}
    student_s = med["student forward"] + med["kl"] + med["backward"] + med["optimizer"]
    plain_s = sum(med[k] for k in PLAIN)
    step_cache = med["collate"] + med["teacher cache gather"] + student_s
    step_forward = med["collate"] + med["teacher forward"] + student_s
    tok = statistics.mean(tokens)
    return {"threads": threads, "steps_timed": steps, "batch_size": p.batch_size,
            "tokens_per_step": tok, "padded_tokens_per_step": statistics.mean(padded),
            "seconds": {k: round(v, 5) for k, v in med.items()},
            "qat_step_s": {"teacher_cache": round(step_cache, 5), "teacher_forward": round(step_forward, 5)},
            "tokens_per_s": {"teacher_cache": round(tok / step_cache, 1), "teacher_forward": round(tok / step_forward, 1),
                             "plain_step": round(tok / (med["collate"] + med["teacher forward"] + plain_s), 1)},
            "overhead_vs_plain": round(student_s / plain_s, 3),
            "fake_quant_forward_s": round(med["student forward"] - med["plain forward"], 5),
            "teacher_cache": {"seconds": round(cache_s, 2), "bytes": cache_bytes, "sequences": len(cache)},
            "ptq_start_s": round(start_s, 2)}


def markdown(result: dict) -> str:
    lines = [f"# QAT throughput ({result['format']}, {result['cpu']})", "",
             f"Machine: {result['cpu']} ({', '.join(result['cpu_flags'])}), {result['cores']} cores; torch "
             f"{result['torch']}. Medians of {result['runs'][0]['steps_timed']} steps of batch "
             f"{result['runs'][0]['batch_size']}; the CPU was shared with other work, so read the ratios within a row.",
             "", "| threads | QAT step, cached teacher (s) | tokens/s | per-step teacher forward (s) | tokens/s | "
             "plain step tokens/s | QAT / plain (student part) | fake-quant forward extra (s) | teacher cache: s, MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        lines.append(f"| {r['threads']} | {r['qat_step_s']['teacher_cache']:.3f} | {r['tokens_per_s']['teacher_cache']:.0f} | "
                     f"{r['qat_step_s']['teacher_forward']:.3f} | {r['tokens_per_s']['teacher_forward']:.0f} | "
                     f"{r['tokens_per_s']['plain_step']:.0f} | {r['overhead_vs_plain']:.2f}x | "
                     f"{r['fake_quant_forward_s']:.3f} | {r['teacher_cache']['seconds']:.1f}, "
                     f"{r['teacher_cache']['bytes'] / 1e6:.0f} |")
    lines += ["", "Per part (s, median): " + "; ".join(
        f"{r['threads']} thread(s): " + ", ".join(f"{k} {v:.4f}" for k, v in r["seconds"].items()) for r in result["runs"]),
        "", "Tokens are the real (unpadded) tokens of a step; a batch is padded to its longest sequence "
        f"({result['runs'][0]['tokens_per_step']:.0f} real of {result['runs'][0]['padded_tokens_per_step']:.0f} "
        "padded positions on average).", "", result["note"], "", result["at_11b"], ""]
    return "\n".join(lines)


AT_11B = """## The levers at the 11B preset (configs/llama-3.2-11b-vision.yaml)

- Threads: `qat.threads: null` there (torch's default, every core); on GPUs irrelevant.
- Teacher logits: a full-vocabulary cache is 128,256 x 2 B = 256.5 KB per response token; 261,632 training
  sequences (262,144 prompts less 512 held out) make 67 GB per mean response token, 6.7 TB at 100 tokens: the
  preset keeps `qat.teacher_logits: forward`. The teacher forward is about a third of the student's forward +
  backward FLOPs, so a cache could save at most ~25 % of a step there; a top-k cache (k = 64, bf16 value + int32
  index: 384 B per token, ~10 GB at 100 tokens) would change the loss to a truncated KL and is not implemented.
- Padding: batches are padded to their longest sequence (not `max_seq_len`); at 512 tokens the waste depends on
  the response-length spread, as here.
- bf16 autocast and torch.compile: not adopted (see README); at 11B on GPUs `launch.compute_dtype: bfloat16`
  (FSDP2 mixed precision) is the bf16 lever."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="s3d8")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="reports/qat_throughput")
    parser.add_argument("--note", default="", help="a line for the report (the conditions of the run)")
    args = parser.parse_args()
    import os

    result = {"format": args.format, "cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
              "torch": torch.__version__, "runs": [measure(args.format, t, args.steps, args.params) for t in args.threads],
              "note": args.note, "at_11b": AT_11B}
    write_json(f"{args.out}.json", result)
    write_text(f"{args.out}.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
