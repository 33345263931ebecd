"""The skeleton on one CUDA GPU: the direct cast that QAT starts from, a few QAT steps from it, a teacher-generate
shard; throughput and peak GPU memory of each.

    pipeline/bench/gpu_check.sh [--out FILE] [--preset full] [--algorithm gptq] [--steps 4] [--batch 4] [--seq 512]
    pipeline/bench/gpu_check.sh --device cpu --preset tiny --steps 1 --batch 2 --seq 64    # the same code, no GPU

Builds the 11B-shaped skeleton (``pipeline/bench/skeleton_11b.py``, preset ``full``: 1.87 B parameters, every width
of the 11B; it fits one 80 GB GPU: bf16 teacher 3.7 GB + fp32 student, gradients and AdamW 30 GB + activations)
unless it is already under ``checkpoints/skeleton-11b/<preset>/model``, gives every matrix one S3D8 table (fitted
once on the embedding: throughput does not depend on the table; ``--fit`` fits each matrix as the pipeline does),
then on the device:

- cast: stage direct-cast's work (``pipeline.cast.direct.cast_group`` by ``--algorithm``, every matrix on the GPU as
  the stage puts it there) with a synthetic ``X^T X`` per Linear (a skeleton has no calibration data; GPTQ's cost
  does not depend on the values); seconds per matrix, and from them the 11B's direct cast on 1 and on 8 GPUs
  (its 526 matrices by shape, dealt to 8 processes as the stage deals them). One matrix is also cast on the CPU:
  the seconds there and how many packed bytes and scales agree;
- QAT: ``pipeline.qat.train.train`` under FSDP2 on one process (NCCL), bf16 compute, gradient checkpointing,
  from that direct cast (``qat.init: ptq``, the recipe's start), ``--steps`` optimizer steps of ``--batch``
  sequences of ``--seq`` tokens with one image each (the preset's tiles);
- teacher-generate: ``pipeline.teacher.generate_answers.generate_shard`` on a shard of ``--gen-prompts`` prompts,
  bf16, sampled.

Writes a JSON (default ``$OUT/gpu_check.json`` when ``$OUT`` is set, else ``checkpoints/skeleton-11b/gpu_check.json``),
rewritten after each phase: seconds and ``torch.cuda.max_memory_allocated`` per phase, and the memory model's
prediction for the same run. Without a CUDA GPU (and without ``--device cpu``) it prints why and exits with
status 2 before building anything.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

from pipeline.bench.gpu_check_cast import cast_check

ROOT = Path(__file__).resolve().parents[2]

NO_GPU_STATUS = 2


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    try:
        import torch
    except ImportError as e:                      # pragma: no cover  (the venv has torch)
        return f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        extra = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return (f"no CUDA GPU visible (torch {torch.__version__}, {build}{extra}): this check needs one; "
                f"nothing was built or measured")
    return None


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return ROOT / "checkpoints" / "skeleton-11b" / "gpu_check.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Phases:
    """Wall time and, on a GPU, ``torch.cuda.max_memory_allocated`` per phase (the peak statistics reset at each
    start); the device is synchronised at each boundary, so a phase's time includes its queued kernels."""

    def __init__(self, device) -> None:
        self.device = device
        self.records: dict[str, dict] = {}
        self.current: tuple[str, float] | None = None

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def enter(self, name: str) -> None:
        import torch

        self.exit()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.current = (name, time.perf_counter())

    def exit(self) -> None:
        import torch

        if self.current is None:
            return
        name, t0 = self.current
        self.sync()
        rec = {"seconds": round(time.perf_counter() - t0, 3)}
        if self.device.type == "cuda":
            rec.update({"max_memory_allocated_gb": round(torch.cuda.max_memory_allocated(self.device) / 1e9, 3),
                        "max_memory_reserved_gb": round(torch.cuda.max_memory_reserved(self.device) / 1e9, 3),
                        "memory_allocated_end_gb": round(torch.cuda.memory_allocated(self.device) / 1e9, 3)})
        self.records[name] = rec
        self.current = None


def ensure_skeleton(preset: str, fit: bool) -> dict:
    """The skeleton's directory and S3D8 states (built / fitted when absent)."""
    from pipeline.bench import skeleton_11b_steps as S
    from pipeline import formats

    d = S.dirs(preset)
    info = {"model_dir": str(d["model"])}
    t0 = time.perf_counter()
    if not (d["model"] / "skeleton.json").exists():
        S.build(d["model"], S.PRESETS[preset])
        info["build_seconds"] = round(time.perf_counter() - t0, 1)
    fmt = formats.get(formats.SUBJECT)
    if not d["states"].exists():
        t0 = time.perf_counter()
        if fit:
            from pipeline.cast.fit import fit_model
            states, _ = fit_model(fmt, str(d["model"]))
            info["states"] = "fitted per matrix (pipeline.cast.fit.fit_model)"
        else:
            states = shared_table_states(preset)
            info["states"] = "one table fitted on the token embedding, shared by every matrix"
        fmt.save_states(d["states"], states)
        info["fit_seconds"] = round(time.perf_counter() - t0, 1)
    return info


def shared_table_states(preset: str) -> dict:
    from pipeline.bench import skeleton_11b_steps as S
    from pipeline import formats
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.models import meta_model, quantised_weight_names

    d = S.dirs(preset)
    fmt = formats.get(formats.SUBJECT)
    names = quantised_weight_names(meta_model(S.skeleton_config(S.PRESETS[preset])))
    embed = next(saved for saved in names.values() if saved.endswith("embed_tokens.weight"))
    state = fmt.fit(CheckpointReader(d["model"]).get(embed).float())
    return {saved.removesuffix(".weight"): state for saved in names.values()}


# --- QAT and generation ---------------------------------------------------------------------------------------

class StepLog:
    """What ``pipeline.qat.train`` logs through dvclive's ``Live``, kept in memory: on a GPU machine without dvclive
    (it pulls in dvc) it stands in for it, and the per-step metrics go into this check's JSON."""

    records: list[dict] = []

    def __init__(self, *args, **kwargs) -> None:
        self.step = 0

    def log_metric(self, name: str, value) -> None:
        if not StepLog.records or StepLog.records[-1]["step"] != self.step:
            StepLog.records.append({"step": self.step, "clock_s": round(time.perf_counter(), 3)})
        StepLog.records[-1][name] = float(value)

    def next_step(self) -> None:
        pass

    def end(self) -> None:
        pass


def ensure_dvclive() -> str:
    """``dvclive``, or :class:`StepLog` in its place where it is not installed; says which."""
    try:
        import dvclive  # noqa: F401
        return "dvclive"
    except ImportError:
        import types
        sys.modules["dvclive"] = types.SimpleNamespace(Live=StepLog)
        return "not installed: per-step metrics kept by gpu_check.StepLog"


def qat_check(preset: str, steps: int, batch: int, seq: int, phases: Phases, cast_dir: str | None) -> dict:
    import pipeline.qat.train as qt
    from pipeline.qat.engines import FSDP2Engine
    import pipeline.toy  # noqa: F401  (the toy image pool)
    from pipeline.bench import skeleton_11b_steps as S
    from pipeline import formats
    from pipeline.cast.direct import DirectCast
    from pipeline.launch.processes import LaunchParams
    from pipeline.params import defaults
    from pipeline.models import load_processor

    rendezvous = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(_free_port())}
    before = {key: os.environ.get(key) for key in rendezvous}       # restored after: later processes start clean
    for key, value in rendezvous.items():
        os.environ.setdefault(key, value)
    d = S.dirs(preset)
    fmt = formats.get(formats.SUBJECT)
    states = fmt.load_states(d["states"])
    processor = load_processor(str(d["model"]))
    prompt_len = len(S._examples(processor, d["model"], 1, 1)[0].prompt_ids)
    examples = S._examples(processor, d["model"], max(batch * steps, batch), seq - prompt_len - 1)
    engine = FSDP2Engine
    orig = {k: getattr(engine, k) for k in ("teacher", "student", "save_student")}

    def teacher_hook(self, *args):
        r = orig["teacher"](self, *args)
        phases.enter("qat_load_student")
        return r

    def student_hook(self, *args):
        # rank 0 loads the student (and its post-training start); every rank builds it on meta, shards it and
        # receives its shards
        r = orig["student"](self, *args)
        phases.enter("qat_train")
        return r

    def save_hook(self, student, proc, out_dir, *rest):
        phases.enter("qat_save_student")
        return orig["save_student"](self, student, proc, out_dir, *rest)

    logger = ensure_dvclive()
    engine.teacher, engine.student, engine.save_student = teacher_hook, student_hook, save_hook
    cuda = phases.device.type == "cuda"
    launch = defaults(LaunchParams, "launch", num_processes=1, backend="nccl" if cuda else "gloo", strategy="fsdp2",
                      compute_dtype="bfloat16", gradient_checkpointing=True, teacher="replicate")
    start = DirectCast(cast_dir, fmt).start if cast_dir else None
    p = defaults(qt.QATParams, "qat", steps=steps, batch_size=batch, grad_accum=1, max_seq_len=seq,
                 checkpoint_every=10**6, threads=0, init="ptq" if start else "teacher")
    work = d["model"].parent / "gpu_qat"
    phases.enter("qat_load_teacher")
    try:
        summary = qt.train(fmt, states, str(d["model"]), "bfloat16", examples, p, out_dir=work / "student",
                           checkpoint=work / "ckpt.safetensors", live_dir=work / "live", fingerprint="gpu-check",
                           launch=launch, start=start)
    finally:
        phases.exit()
        for k, v in orig.items():
            setattr(engine, k, v)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    train = phases.records["qat_train"]
    tokens = batch * seq * steps
    return {"steps": steps, "batch": batch, "seq": seq, "init": p.init, "summary": summary, "dvclive": logger,
            "step_metrics": StepLog.records,
            "steps_per_s": round(steps / train["seconds"], 4), "tokens_per_s": round(tokens / train["seconds"], 1),
            "max_memory_allocated_gb": max((r.get("max_memory_allocated_gb", 0) for k, r in phases.records.items()
                                            if k.startswith("qat_")), default=None),
            "note": "qat_train's time includes the first step's warm-up (kernels, allocator) and, with the KL "
                    "cache, the teacher's forward over every training sequence"}


def generate_check(preset: str, prompts: int, max_new_tokens: int, phases: Phases) -> dict:
    import pyarrow as pa
    import torch

    import pipeline.toy  # noqa: F401
    from pipeline.bench import skeleton_11b_steps as S
    from pipeline.teacher.generate_answers import GenerateParams, generate_shard
    from pipeline.params import defaults
    from pipeline.models import load_model, load_processor

    d = S.dirs(preset)
    phases.enter("generate_load_teacher")
    model = load_model(str(d["model"]), torch.bfloat16).to(phases.device)
    processor = load_processor(str(d["model"]))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    table = pa.table({"index": list(range(prompts)), "image_ref": [f"toy:0:{i}" for i in range(prompts)],
                      "prompt": [prompt] * prompts, "template": ["chat"] * prompts, "seed": [0] * prompts})
    p = defaults(GenerateParams, "generate", batch_size=prompts, max_new_tokens=max_new_tokens, temperature=0.6,
                 top_p=0.9, threads=0)
    phases.enter("generate_shard")
    rows = generate_shard(model, processor, table, p, shard_seed=0)
    phases.exit()
    new_tokens = sum(len(r["response_ids"]) for r in rows)
    seconds = phases.records["generate_shard"]["seconds"]
    return {"prompts": prompts, "max_new_tokens": max_new_tokens, "generated_tokens": new_tokens,
            "tokens_per_s": round(new_tokens / seconds, 2), "prompts_per_s": round(prompts / seconds, 3),
            "max_memory_allocated_gb": phases.records["generate_shard"].get("max_memory_allocated_gb")}


def predicted(preset: str, batch: int, seq: int, steps: int = 1, response_tokens: int = 0) -> dict:
    """The memory model's QAT bytes for this check's run: with the teacher's logits cached (``qat.teacher_logits:
    cache``, on the GPU) for ``steps x batch`` sequences of ``response_tokens`` scored tokens."""
    from pipeline.bench import skeleton_11b_steps as S

    cfg = S.skeleton_config(S.PRESETS[preset])
    cache = steps * batch * response_tokens * (cfg.text_config.vocab_size + 1) * 2
    m = S.qat_memory(cfg, devices=1, workload=S.Workload(batch, seq, cfg.vision_config.max_num_tiles),
                     compute_bytes=2, teacher="replicate", checkpointing=True, kl_cache_bytes=cache)
    return {"total_gb": round(m["total"] / 1e9, 2), "parts_gb": {k: round(v / 1e9, 2) for k, v in m["parts"].items()}}


CHECKS = ("cast", "qat", "generate")
REPORT = ROOT / "reports" / "gpu_check"


def step_seconds(qat: dict) -> float | None:
    """Median seconds between logged steps (after the first: it carries the warm-up and the KL cache)."""
    clocks = [r["clock_s"] for r in qat.get("step_metrics", []) if "clock_s" in r]
    gaps = sorted(b - a for a, b in zip(clocks, clocks[1:]))
    return round(gaps[len(gaps) // 2], 3) if gaps else None


def write_report(files: list[Path], env: str = "") -> None:
    """``reports/gpu_check.{json,md}`` from result files of this script (run on a GPU machine)."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    for r in runs:
        q = r.get("qat", {})
        if "steps" in q:
            q["seconds_per_step_steady"] = step_seconds(q)
            # the memory model as it is now (a prediction, recomputed: the runs may predate a term)
            tokens = q["step_metrics"][0]["train/tokens"] / q["batch"] if q.get("step_metrics") else q["seq"]
            r["predicted_qat"] = predicted(r["preset"], q["batch"], q["seq"], q["steps"], tokens)
    doc = {"runs": runs, "machine": env.strip()}
    REPORT.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# The skeleton on one GPU: direct cast, QAT, teacher-generate", "",
             "Written by `python -m pipeline.bench.gpu_check --report` from runs of `pipeline/bench/gpu_check.sh` on a "
             "lent GPU "
             "machine (numbers: `reports/gpu_check.json`).", ""]
    if env.strip():
        lines += ["```", env.strip(), "```", ""]
    for r in runs:
        lines += [f"## Run: preset {r['preset']}, {r['device']}, torch {r['torch']}, "
                  f"{r['cpu_threads']} CPU threads, {r.get('seconds')} s", ""]
        c = r.get("cast")
        if c and "error" not in c:
            lines += [f"Direct cast ({c['algorithm']}, synthetic X^T X, every matrix on {c['device']}): "
                      f"{c['matrices']} matrices, {c['weights'] / 1e9:.3f} B weights in {c['seconds']:.1f} s.", "",
                      "| shape | seconds |", "|---|---:|"]
            lines += [f"| {k} | {v} |" for k, v in c["seconds_by_shape"].items()]
            lines += ["", "Llama 3.2 11B Vision's direct cast from these seconds (its matrices by shape, dealt as "
                      "stage direct-cast deals them):", "", "| processes | seconds |", "|---:|---:|"]
            lines += [f"| {p['processes']} | {p['seconds']} |" for p in c["predicted_11b"]]
            cmp_ = c.get("cpu_vs_device", {})
            if "error" not in cmp_ and cmp_:
                lines += ["", f"One matrix on both ({cmp_['matrix']}, {cmp_['shape']}): CPU ({cmp_['threads']} "
                          f"threads) {cmp_['cpu_seconds']} s, GPU {cmp_['device_seconds']} s; packed bytes equal "
                          f"{cmp_['packed_bytes_equal']:.4f}, scales {cmp_['scales_equal']:.4f}, tables "
                          f"{cmp_['tables_equal']}, masters {cmp_['masters_equal']:.4f}; relative output error "
                          f"{cmp_['relative_output_error_cpu']:.6f} (CPU) / {cmp_['relative_output_error_device']:.6f} "
                          "(GPU)."]
            lines += [""]
        q = r.get("qat")
        if q and "error" not in q:
            pred = r.get("predicted_qat", {})
            steady = q.get("seconds_per_step_steady")
            steady = f"{steady} s per step after the first" if steady else "step times not recorded by that run"
            ratio = q["max_memory_allocated_gb"] / pred["total_gb"] if pred.get("total_gb") else float("nan")
            lines += [f"QAT (FSDP2, 1 process, bf16 compute, gradient checkpointing, init {q['init']}): {q['steps']} "
                      f"steps of {q['batch']} x {q['seq']} tokens; {q['steps_per_s']} steps/s over the whole train "
                      f"phase, {steady}; KL {q['summary']['kl_first']:.4f} -> {q['step_metrics'][-1]['train/kl']:.4f}; "
                      f"peak {q['max_memory_allocated_gb']} GB allocated, the memory model {pred.get('total_gb')} GB "
                      f"(measured / predicted {ratio:.2f}; "
                      f"{', '.join(f'{k} {v}' for k, v in pred.get('parts_gb', {}).items())}).", ""]
        g = r.get("generate")
        if g and "error" not in g:
            lines += [f"Teacher-generate (bf16, sampled): {g['prompts']} prompts x {g['max_new_tokens']} new tokens, "
                      f"{g['tokens_per_s']} tokens/s, peak {g['max_memory_allocated_gb']} GB.", ""]
        for k in CHECKS:
            if k in r and "error" in r[k]:
                lines += [f"{k}: failed: {r[k]['error']}", ""]
    REPORT.with_suffix(".md").write_text("\n".join(lines))
    print(f"gpu_check: wrote {REPORT.with_suffix('.md')} and .json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--preset", default="full", help="a preset of pipeline/bench/skeleton_11b.py (full, qat, tiny)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the same code without a GPU (a dry run of this script)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"which of {', '.join(CHECKS)}, comma-separated")
    parser.add_argument("--algorithm", choices=("gptq", "search"), default="gptq", help="the direct cast's algorithm")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--gen-prompts", type=int, default=8)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--fit", action="store_true", help="fit every matrix (slow on few cores)")
    parser.add_argument("--report", type=Path, nargs="+", metavar="RESULT",
                        help="write reports/gpu_check.{json,md} from result files of earlier runs; run nothing")
    parser.add_argument("--env", type=Path, help="with --report: a text file describing the GPU machine")
    args = parser.parse_args(argv)
    if args.report:
        write_report(args.report, args.env.read_text() if args.env else "")
        return 0
    checks = [c for c in args.checks.split(",") if c]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        parser.error(f"--checks: unknown {', '.join(unknown)} (choose from {', '.join(CHECKS)})")
    reason = no_gpu_reason() if args.device == "cuda" else None
    if reason:
        print(f"gpu_check: {reason}", file=sys.stderr)
        return NO_GPU_STATUS
    import torch

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "preset": args.preset, "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        result["total_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    from pipeline.formats.s3d8 import native_or_none
    result["native_kernels"] = native_or_none() is not None
    t0 = time.perf_counter()
    result["skeleton"] = ensure_skeleton(args.preset, args.fit)
    phases = Phases(device)

    def save():
        result["phases"] = phases.records
        result["seconds"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    runs = {"cast": lambda: cast_check(args.preset, args.algorithm, device, phases),
            "qat": lambda: qat_check(args.preset, args.steps, args.batch, args.seq, phases,
                                     result.get("cast", {}).get("out_dir")),
            "generate": lambda: generate_check(args.preset, args.gen_prompts, args.gen_tokens, phases)}
    for name in checks:
        print(f"gpu_check: {name} ...", flush=True)
        try:
            result[name] = runs[name]()
        except Exception as e:  # noqa: BLE001  (record it, go on to the next check)
            import traceback
            phases.current = None
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"gpu_check: {name}: {json.dumps(result[name], default=str)[:1500]}", flush=True)
        save()
    if "qat" in checks and "error" not in result["qat"]:
        logged = result["qat"]["step_metrics"]
        tokens = logged[0]["train/tokens"] / args.batch if logged else args.seq       # else: a bound
        result["predicted_qat"] = predicted(args.preset, args.batch, args.seq, args.steps, tokens)
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}, indent=1, default=str))
    print(f"gpu_check: wrote {out}")
    return 0 if all("error" not in result[k] for k in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
