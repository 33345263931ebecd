"""The skeleton on one CUDA GPU: a few QAT steps and a teacher-generate shard, with throughput and peak GPU memory.

    benchmarks/gpu_check.sh [--out FILE] [--preset full] [--steps 4] [--batch 4] [--seq 512] [--gen-prompts 8]

Builds the 11B-shaped skeleton (``benchmarks/skeleton_11b.py``, preset ``full``: 1.87 B parameters, every width
of the 11B; it fits one 80 GB GPU: bf16 teacher 3.7 GB + fp32 student, gradients and AdamW 30 GB + activations)
unless it is already under ``checkpoints/skeleton-11b/<preset>/model``, gives every matrix one S3D8 table (fitted
once on the embedding: throughput does not depend on the table; ``--fit`` fits each matrix as the pipeline does),
then on ``cuda:0``:

- QAT: ``pipeline.qat.train.train`` under FSDP2 on one process (NCCL), bf16 compute, gradient checkpointing,
  ``--steps`` optimizer steps of ``--batch`` sequences of ``--seq`` tokens with one image each (4 tiles);
- teacher-generate: ``pipeline.generate.generate_shard`` on a shard of ``--gen-prompts`` prompts, bf16, sampled.

Writes a JSON (default ``$OUT/gpu_check.json`` when ``$OUT`` is set, else ``checkpoints/skeleton-11b/gpu_check.json``):
steps/s, tokens/s, ``torch.cuda.max_memory_allocated`` per phase, and the memory model's prediction for the same run.
Without a CUDA GPU it prints why and exits with status 2 before building anything.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

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


class CudaPhases:
    """Wall time and ``torch.cuda.max_memory_allocated`` per phase (the peak statistics reset at each start)."""

    def __init__(self) -> None:
        self.records: dict[str, dict] = {}
        self.current: tuple[str, float] | None = None

    def enter(self, name: str) -> None:
        import torch

        self.exit()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.current = (name, time.perf_counter())

    def exit(self) -> None:
        import torch

        if self.current is None:
            return
        name, t0 = self.current
        torch.cuda.synchronize()
        self.records[name] = {"seconds": round(time.perf_counter() - t0, 3),
                              "max_memory_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
                              "max_memory_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 3),
                              "memory_allocated_end_gb": round(torch.cuda.memory_allocated() / 1e9, 3)}
        self.current = None


def ensure_skeleton(preset: str, fit: bool) -> dict:
    """The skeleton's directory and S3D8 states (built / fitted when absent)."""
    import skeleton_11b as S
    from pipeline import formats

    d = S.dirs(preset)
    info = {"model_dir": str(d["model"])}
    t0 = time.perf_counter()
    if not (d["model"] / "skeleton.json").exists():
        S.build(d["model"], S.PRESETS[preset])
        info["build_seconds"] = round(time.perf_counter() - t0, 1)
    fmt = formats.get("s3d8")
    if not d["states"].exists():
        t0 = time.perf_counter()
        if fit:
            from pipeline.fit import fit_model
            states, _ = fit_model(fmt, str(d["model"]))
            info["states"] = "fitted per matrix (pipeline.fit.fit_model)"
        else:
            states = shared_table_states(preset)
            info["states"] = "one table fitted on the token embedding, shared by every matrix"
        fmt.save_states(d["states"], states)
        info["fit_seconds"] = round(time.perf_counter() - t0, 1)
    return info


def shared_table_states(preset: str) -> dict:
    import skeleton_11b as S
    from pipeline import formats
    from pipeline.checkpoint import CheckpointReader
    from pipeline.models import meta_model, quantised_weight_names

    d = S.dirs(preset)
    fmt = formats.get("s3d8")
    names = quantised_weight_names(meta_model(S.skeleton_config(S.PRESETS[preset])))
    embed = next(saved for saved in names.values() if saved.endswith("embed_tokens.weight"))
    state = fmt.fit(CheckpointReader(d["model"]).get(embed).float())
    return {saved.removesuffix(".weight"): state for saved in names.values()}


def qat_check(preset: str, steps: int, batch: int, seq: int, phases: CudaPhases) -> dict:
    import torch

    import pipeline.qat.train as qt
    import pipeline.toy  # noqa: F401  (the toy image pool)
    import skeleton_11b as S
    from pipeline import formats
    from pipeline.launch import LaunchParams
    from pipeline.models import load_processor

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(key, value)
    d = S.dirs(preset)
    fmt = formats.get("s3d8")
    states = fmt.load_states(d["states"])
    processor = load_processor(str(d["model"]))
    prompt_len = len(S._examples(processor, d["model"], 1, 1)[0].prompt_ids)
    examples = S._examples(processor, d["model"], max(batch * steps, batch), seq - prompt_len - 1)
    engine = qt._FSDP2
    orig = {k: getattr(engine, k) for k in ("teacher", "student", "save_student")}

    def teacher_hook(self, *args):
        r = orig["teacher"](self, *args)
        phases.enter("qat_load_student")
        return r

    def student_hook(self, *args):
        # rank 0 loads the student; every rank builds it on meta, shards it and receives its shards
        r = orig["student"](self, *args)
        phases.enter("qat_train")
        return r

    def save_hook(self, student, proc, out_dir, *rest):
        phases.enter("qat_save_student")
        return orig["save_student"](self, student, proc, out_dir, *rest)

    engine.teacher, engine.student, engine.save_student = teacher_hook, student_hook, save_hook
    launch = LaunchParams(num_processes=1, backend="nccl", strategy="fsdp2", compute_dtype="bfloat16",
                          gradient_checkpointing=True, teacher="replicate")
    p = qt.QATParams(steps=steps, batch_size=batch, grad_accum=1, max_seq_len=seq, checkpoint_every=10**6, threads=0,
                     init="teacher")
    work = d["model"].parent / "gpu_qat"
    phases.enter("qat_load_teacher")
    try:
        summary = qt.train(fmt, states, str(d["model"]), "bfloat16", examples, p, out_dir=work / "student",
                           checkpoint=work / "ckpt.safetensors", live_dir=work / "live", fingerprint="gpu-check",
                           launch=launch)
    finally:
        phases.exit()
        for k, v in orig.items():
            setattr(engine, k, v)
    train = phases.records["qat_train"]
    tokens = batch * seq * steps
    return {"steps": steps, "batch": batch, "seq": seq, "summary": summary,
            "steps_per_s": round(steps / train["seconds"], 4), "tokens_per_s": round(tokens / train["seconds"], 1),
            "max_memory_allocated_gb": max(r["max_memory_allocated_gb"] for k, r in phases.records.items()
                                           if k.startswith("qat_")),
            "note": "qat_train's time includes the first step's warm-up (kernels, allocator)"}


def generate_check(preset: str, prompts: int, max_new_tokens: int, phases: CudaPhases) -> dict:
    import pyarrow as pa
    import torch

    import pipeline.toy  # noqa: F401
    import skeleton_11b as S
    from pipeline.generate import GenerateParams, generate_shard
    from pipeline.models import load_model, load_processor

    d = S.dirs(preset)
    phases.enter("generate_load_teacher")
    model = load_model(str(d["model"]), torch.bfloat16).to("cuda")
    processor = load_processor(str(d["model"]))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    table = pa.table({"index": list(range(prompts)), "image_ref": [f"toy:0:{i}" for i in range(prompts)],
                      "prompt": [prompt] * prompts, "template": ["chat"] * prompts, "seed": [0] * prompts})
    p = GenerateParams(batch_size=prompts, max_new_tokens=max_new_tokens, temperature=0.6, top_p=0.9, threads=0)
    phases.enter("generate_shard")
    rows = generate_shard(model, processor, table, p, shard_seed=0)
    phases.exit()
    new_tokens = sum(len(r["response_ids"]) for r in rows)
    seconds = phases.records["generate_shard"]["seconds"]
    return {"prompts": prompts, "max_new_tokens": max_new_tokens, "generated_tokens": new_tokens,
            "tokens_per_s": round(new_tokens / seconds, 2), "prompts_per_s": round(prompts / seconds, 3),
            "max_memory_allocated_gb": phases.records["generate_shard"]["max_memory_allocated_gb"]}


def predicted(preset: str, batch: int, seq: int) -> dict:
    import skeleton_11b as S

    cfg = S.skeleton_config(S.PRESETS[preset])
    m = S.qat_memory(cfg, devices=1, workload=S.Workload(batch, seq, cfg.vision_config.max_num_tiles),
                     compute_bytes=2, teacher="replicate", checkpointing=True)
    return {"total_gb": round(m["total"] / 1e9, 2), "parts_gb": {k: round(v / 1e9, 2) for k, v in m["parts"].items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--preset", default="full", help="a preset of benchmarks/skeleton_11b.py (full, qat, tiny)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--gen-prompts", type=int, default=8)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--fit", action="store_true", help="fit every matrix (slow on few cores)")
    args = parser.parse_args(argv)
    reason = no_gpu_reason()
    if reason:
        print(f"gpu_check: {reason}", file=sys.stderr)
        return NO_GPU_STATUS
    import torch

    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "preset": args.preset,
              "total_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)}
    t0 = time.perf_counter()
    result["skeleton"] = ensure_skeleton(args.preset, args.fit)
    phases = CudaPhases()
    for name, fn in (("qat", lambda: qat_check(args.preset, args.steps, args.batch, args.seq, phases)),
                     ("generate", lambda: generate_check(args.preset, args.gen_prompts, args.gen_tokens, phases))):
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001  (record it, go on to the next check)
            import traceback
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        finally:
            torch.cuda.empty_cache()
        result["phases"] = phases.records
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    result["predicted_qat"] = predicted(args.preset, args.batch, args.seq)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}, indent=1, default=str))
    print(f"gpu_check: wrote {out}")
    return 0 if all("error" not in result[k] for k in ("qat", "generate")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
