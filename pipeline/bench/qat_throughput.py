"""QAT throughput: tokens per second of a qat-train step and its cost against a plain fine-tuning step.

One step of the default config (params.yaml: qat.batch_size sequences, the toy teacher, the teacher answers in
data/teacher, the fitted state in data/centroids, the GPTQ start from data/calibration), split into collate,
teacher logits (a bf16 forward per step, or the gather from the once-computed cache), student forward (fake
quantised weights and activations), KL, backward and optimizer; the plain step runs the same batch through the
unquantised fp32 student. Per thread count, medians over the timed steps. Then two levers on the fake-quant
student's forward + KL + backward, weights held fixed, the same batches, each timed against the fp32 path in
the same loop: bf16 autocast (``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward, the KL in
fp32) and ``torch.compile`` (inductor); for each, how far the KL and the gradients land from fp32 (relative).
Usage (after the upstream stages):

    .venv/bin/python -m pipeline.bench.qat_throughput [--format s3d8] [--threads 1 2] [--steps 8] [--no-compile]

Writes reports/qat_throughput.json and reports/qat_throughput.md.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import time
from pathlib import Path

import torch

import pipeline.toy  # noqa: F401  (the toy image pool of the teacher answers)
from pipeline import formats, params
from pipeline.cast import ptq
from pipeline.bench import machine
from pipeline.cast.calibrate import CALIBRATION, Calibration
from pipeline.cast.fit import check_states
from pipeline.files.atomic import write_json, write_text
from pipeline.models import dtype_of, load_config, load_model, load_processor, token_ids
from pipeline.teacher.answers import batch_indices, collate, load_examples, sequence_lengths, split_heldout
from pipeline.divergence import kl_sum
from pipeline.qat.train import QATParams, quantise_student
from pipeline.teacher.logits import TeacherLogits, head_rows
from pipeline.teacher.source import TeacherParams

PARTS = ["collate", "teacher forward", "teacher cache gather", "student forward", "kl", "backward", "optimizer"]
PLAIN = ["plain forward", "plain kl", "plain backward", "plain optimizer"]
LOSS_RTOL, GRAD_RTOL = 1e-2, 5e-2     # "same results": bf16 keeps 8 mantissa bits (2**-8 = 0.4 %)
PAYS = 1.1                            # a lever pays from a 10 % faster forward + KL + backward


def _fwd_bwd(model, batch: dict, keep: torch.Tensor, target: torch.Tensor, bf16: bool) -> tuple[float, float, dict]:
    """Seconds, KL and ``{name: grad}`` of one student forward + KL + backward (no optimizer step)."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        with head_rows(model, keep):
            s = model(**batch).logits
    kl = kl_sum(s, target)                     # log_softmax in fp32 either way
    kl.backward()
    seconds = time.perf_counter() - t0
    return seconds, float(kl.detach()), {n.removeprefix("_orig_mod."): q.grad.detach().clone()
                            for n, q in model.named_parameters() if q.grad is not None}


def _rel_diffs(kl: float, grads: dict, ref_kl: float, ref: dict) -> tuple[float, float, float]:
    """Relative difference of the KL, of all gradients as one vector (L2) and of the worst parameter's."""
    if grads.keys() != ref.keys():
        raise ValueError(f"gradients of {sorted(set(grads) ^ set(ref))[:3]} exist in one variant only")
    num = sum(float((grads[n].float() - ref[n]).square().sum()) for n in ref)
    den = sum(float(ref[n].square().sum()) for n in ref)
    worst = max(float((grads[n].float() - ref[n]).norm() / ref[n].norm()) for n in ref if ref[n].norm() > 0)
    return abs(kl - ref_kl) / abs(ref_kl), (num / den) ** 0.5, worst


def _compare(name: str, variant, fp32, batches: list, steps: int, bf16: bool = False, limit_s: int = 0) -> dict:
    """Time ``variant`` against ``fp32`` (the same module, or the module it compiles) step by step on the same
    batches; the first call of each is the warm-up (for ``torch.compile`` the compile). With ``limit_s`` the whole
    comparison (first call and timed steps, recompiles included) must end within it, or it is recorded as failed."""
    out = {"steps_timed": steps}

    def on_alarm(signum, frame):
        raise TimeoutError(f"{name}: compile and {steps} steps over {limit_s} s")

    old = signal.signal(signal.SIGALRM, on_alarm) if limit_s else None
    times, ref_times, loss, grad, worst, floor = [], [], [], [], [], []
    try:
        signal.alarm(limit_s)
        first = _fwd_bwd(variant, *batches[0], bf16)[0]
        _fwd_bwd(fp32, *batches[0], False)
        for batch in batches[1:steps + 1]:
            t_ref, kl_ref, g_ref = _fwd_bwd(fp32, *batch, False)
            t, kl, g = _fwd_bwd(variant, *batch, bf16)
            d = _rel_diffs(kl, g, kl_ref, g_ref)
            times.append(t), ref_times.append(t_ref), loss.append(d[0]), grad.append(d[1]), worst.append(d[2])
            if variant is fp32:                         # the fp32 path against itself: the noise floor
                _, kl2, g2 = _fwd_bwd(fp32, *batch, False)
                floor.append(max(_rel_diffs(kl2, g2, kl_ref, g_ref)[:2]))
        signal.alarm(0)
    except Exception as e:  # noqa: BLE001  (a failing lever is a result, recorded as such)
        signal.alarm(0)
        return {**out, "ok": False, "steps_done": len(times), "step_s_done": [round(t, 3) for t in times],
                "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    finally:
        if old is not None:
            signal.signal(signal.SIGALRM, old)
    step, ref = statistics.median(times), statistics.median(ref_times)
    if floor:
        out["fp32_repeat_rel_diff_max"] = float(f"{max(floor):.3g}")
    return {**out, "ok": True, "first_call_s": round(first, 3), "step_s": round(step, 5), "step_s_max": round(max(times), 5),
            "steps_over_5x_fp32": sum(t > 5 * ref for t in times),  # recompiles (a new padded length)
            "fp32_step_s": round(ref, 5), "speedup": round(ref / step, 3),
            "kl_rel_diff_max": float(f"{max(loss):.3g}"), "grad_rel_diff_max": float(f"{max(grad):.3g}"),
            "grad_rel_diff_worst_param": float(f"{max(worst):.3g}"),
            "same_results": max(loss) <= LOSS_RTOL and max(grad) <= GRAD_RTOL}


def _step_batch(train_set, processor, p, step: int):
    """``(picked indices, batch, loss mask)`` of QAT step ``step``, as training draws it."""
    lengths = sequence_lengths(train_set, p.max_seq_len) if p.group_by_length else None
    picked = batch_indices(len(train_set), p.batch_size, step, p.seed, lengths)
    batch = collate([train_set[i] for i in picked], processor, p.max_seq_len)
    return picked, batch, batch.pop("loss_mask").bool()

def measure(fmt_name: str, threads: int, steps: int, params_path: str, compile_limit_s: int) -> dict:
    torch.set_num_threads(threads)
    p = params.load(QATParams, "qat", params_path)
    teacher_p = params.load(TeacherParams, "teacher", params_path)
    heldout = params.read(params_path)["heldout_prompts"]
    fmt = formats.comparison(fmt_name, "--format")
    state_file = Path(f"data/centroids/{fmt.name}.safetensors")
    states = check_states(fmt, fmt.load_states(state_file), state_file)
    train_set, _ = split_heldout(load_examples("data/teacher", token_ids(load_config(teacher_p.source))), heldout)
    calibration = Calibration(CALIBRATION if Path(CALIBRATION).exists() else None)
    start = lambda name, w: ptq.start(fmt, w, algorithm="gptq", hessian=calibration.get(name))  # noqa: E731
    processor = load_processor(teacher_p.source)
    dtype = dtype_of(teacher_p.dtype)
    teacher = load_model(teacher_p.source, dtype).requires_grad_(False)
    t0 = time.perf_counter()
    cache = TeacherLogits(teacher, dtype, train_set, processor, p.max_seq_len, p.batch_size, "cpu")
    cache_s = time.perf_counter() - t0
    cache_bytes = sum(c.numel() * c.element_size() for c in cache.cached)
    student = load_model(teacher_p.source, torch.float32)
    t0 = time.perf_counter()
    quantise_student(student, fmt, states, p, start if calibration.path else None, {})
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

        picked, batch, keep = _step_batch(train_set, processor, p, step)
        tick("collate")
        t_rows = cache.forward({**batch, "loss_mask": keep})
        tick("teacher forward")
        cached = cache.rows(batch, picked)
        tick("teacher cache gather")
        with head_rows(student, keep):
            s = student(**batch).logits
        tick("student forward")
        kl = kl_sum(s, cached)
        tick("kl")
        kl.backward()
        tick("backward")
        opts[0].step(), opts[0].zero_grad(set_to_none=True)
        tick("optimizer")
        with head_rows(plain, keep):
            s = plain(**batch).logits
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
    rest = med["collate"] + med["teacher cache gather"] + med["optimizer"]
    levers = _levers(student, train_set, processor, p, cache, steps, rest, tok, compile_limit_s)
    return {"threads": threads, "steps_timed": steps, "batch_size": p.batch_size,
            "tokens_per_step": tok, "padded_tokens_per_step": statistics.mean(padded),
            "seconds": {k: round(v, 5) for k, v in med.items()},
            "qat_step_s": {"teacher_cache": round(step_cache, 5), "teacher_forward": round(step_forward, 5)},
            "tokens_per_s": {"teacher_cache": round(tok / step_cache, 1), "teacher_forward": round(tok / step_forward, 1),
                             "plain_step": round(tok / (med["collate"] + med["teacher forward"] + plain_s), 1)},
            "overhead_vs_plain": round(student_s / plain_s, 3),
            "fake_quant_forward_s": round(med["student forward"] - med["plain forward"], 5),
            "teacher_cache": {"seconds": round(cache_s, 2), "bytes": cache_bytes, "sequences": len(cache.cached)},
            "ptq_start_s": round(start_s, 2), "levers": levers}


def _levers(student, train_set, processor, p, cache, steps: int, rest: float, tok: float, compile_limit_s: int) -> dict:
    """bf16 autocast and torch.compile timed against the fp32 student on the same batches (``rest``: the step's
    collate, cache gather and optimizer seconds, added to each lever's forward + KL + backward)."""
    batches = []                                    # the same batches again, for the levers
    for step in range(steps + 1):
        picked, batch, keep = _step_batch(train_set, processor, p, step)
        batches.append((batch, keep, torch.cat([cache[i] for i in picked])))
    levers = {"autocast_bf16": _compare("autocast", student, student, batches, steps, bf16=True)}
    if compile_limit_s:
        t0 = time.perf_counter()
        try:
            compiled = torch.compile(student)
            levers["torch_compile"] = _compare("torch.compile", compiled, student, batches, steps, limit_s=compile_limit_s)
        except Exception as e:  # noqa: BLE001
            levers["torch_compile"] = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        levers["torch_compile"]["wall_s"] = round(time.perf_counter() - t0, 1)
    else:
        levers["torch_compile"] = {"ok": False, "error": "not run (--no-compile)"}
    for lever in levers.values():
        if lever["ok"]:
            lever["qat_step_s"] = {"teacher_cache": round(rest + lever["step_s"], 5)}
            lever["tokens_per_s"] = {"teacher_cache": round(tok / (rest + lever["step_s"]), 1)}
    return levers


def verdict(name: str, lever: dict) -> str:
    """A sentence: does the lever pay on this CPU, and is it adopted (no: not in this change)."""
    if not lever["ok"]:
        return f"{name}: no result ({lever['error']}); not adopted."
    pays = lever["speedup"] >= PAYS and lever["same_results"]
    why = (f"{lever['speedup']:.2f}x the fp32 forward + KL + backward, KL within {lever['kl_rel_diff_max']:.1e} and "
           f"gradients within {lever['grad_rel_diff_max']:.1e} (relative L2) of fp32")
    tol = "" if lever["same_results"] else f", outside the tolerance (KL {LOSS_RTOL:g}, gradients {GRAD_RTOL:g})"
    return (f"{name}: {why}{tol}: {'pays' if pays else 'does not pay'} here "
            f"(threshold {PAYS:g}x with same results). Not adopted: the training code is unchanged in this change.")


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
        "padded positions on average).", "", "## Levers: bf16 autocast and torch.compile", "",
        "The fake-quant student's forward + KL + backward (no optimizer step), weights held fixed, on the same "
        "batches as above, each step timed against the fp32 path in the same loop; the QAT step column adds the "
        "median collate, cache gather and optimizer. Autocast wraps the forward in "
        "`torch.autocast(\"cpu\", dtype=torch.bfloat16)` (KL in fp32); compile is `torch.compile(student)` "
        "(inductor), its first call includes the compile.", "",
        "| threads | lever | first call (s) | fwd+KL+bwd (s) | fp32 (s) | speedup | QAT step, cached (s) | tokens/s | "
        "KL rel. diff | grad rel. diff (all / worst tensor) | steps > 5x fp32 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        for name, v in r["levers"].items():
            if not v["ok"]:
                lines.append(f"| {r['threads']} | {name} | failed: {v['error']} | | | | | | | | |")
                continue
            lines.append(f"| {r['threads']} | {name} | {v['first_call_s']:.1f} | {v['step_s']:.3f} | {v['fp32_step_s']:.3f} | "
                         f"{v['speedup']:.2f}x | {v['qat_step_s']['teacher_cache']:.3f} | "
                         f"{v['tokens_per_s']['teacher_cache']:.0f} | {v['kl_rel_diff_max']:.1e} | "
                         f"{v['grad_rel_diff_max']:.1e} / {v['grad_rel_diff_worst_param']:.1e} | "
                         f"{v['steps_over_5x_fp32']} |")
    run = result["runs"][0]
    floor = run["levers"]["autocast_bf16"].get("fp32_repeat_rel_diff_max")
    lines += ["", f"Rel. diff: max over the timed steps of |x - x_fp32| / |x_fp32| (gradients: all as one vector, and "
              f"the worst single tensor); the fp32 path run twice differs by {floor} (noise floor). Steps over 5x the "
              "fp32 time are recompiles (a new padded length). The fake quantiser maps values to bins, so even compile's "
              "reordered fp32 arithmetic can move a value across a bin edge: its differences need not be zero.",
              "", f"On {result['cpu']} at {run['threads']} thread(s): "
              + verdict("bf16 autocast", run["levers"]["autocast_bf16"]) + " "
              + verdict("torch.compile", run["levers"]["torch_compile"]),
              "", result["note"], "", result["at_11b"], ""]
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
- bf16 autocast and torch.compile: measured above on this CPU, not adopted (see README); at 11B on GPUs
  `launch.compute_dtype: bfloat16` (FSDP2 mixed precision) is the bf16 lever."""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.qat_throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--format", default=formats.SUBJECT)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="reports/qat_throughput")
    parser.add_argument("--note", default="", help="a line for the report (the conditions of the run)")
    parser.add_argument("--compile-limit", type=int, default=600,
                        help="seconds allowed for the torch.compile lever (compile and timed steps)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile lever")
    args = parser.parse_args()
    import os

    result = {"format": args.format, "cpu": machine.describe()["cpu"], "cpu_flags": machine.describe()["flags"], "cores": os.cpu_count(),
              "torch": torch.__version__, "runs": [measure(args.format, t, args.steps, args.params, 0 if args.no_compile else args.compile_limit)
                                                                   for t in args.threads],
              "note": args.note, "at_11b": AT_11B}
    write_json(f"{args.out}.json", result)
    write_text(f"{args.out}.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
