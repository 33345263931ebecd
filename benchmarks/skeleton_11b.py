"""An "11B-shaped" skeleton of Llama 3.2 11B Vision, run through every pipeline step, with a memory model.

The skeleton is a seeded, randomly initialised ``MllamaForConditionalGeneration`` with the 11B model's widths
(text hidden 4096, MLP 14336, vocabulary 128,256 + the image token, 32 query / 8 KV heads; vision width 1280,
MLP 5120, 560-pixel tiles of 14-pixel patches, 4 tiles: 4 x 1601 = 6,404 image tokens a picture, 7680-wide
vision output) and few layers (text: 2 self-attention + 1 cross-attention; vision: 2 local + 1 global). It is
saved like a hub checkpoint (``save_pretrained``, bf16, processor, generation config) and then fitted, packed,
loaded (lazy and eager), run (one image + prompt, a few generated tokens) and trained (QAT, 2 processes, FSDP2),
each step in a fresh subprocess whose peak RSS (VmHWM) is recorded.

    .venv/bin/python benchmarks/skeleton_11b.py all            # every step; reports/skeleton_11b.{json,md}
    .venv/bin/python benchmarks/skeleton_11b.py step fit       # one step (what ``all`` runs in a subprocess)
    .venv/bin/python benchmarks/skeleton_11b.py model          # the memory model of the full 11B, printed

The memory model (:func:`qat_memory`, :func:`step_memory`) extrapolates each step to the full 11B on 8 GPUs
with FSDP2 from parameter counts taken from ``MllamaConfig`` on the ``meta`` device (:func:`count_params`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline.memory_plan import GB, Workload, count_params, qat_device, step_host  # noqa: E402

WORK = ROOT / "checkpoints" / "skeleton-11b"      # ignored by git (checkpoints/), outside every DVC output
REPORT_JSON = ROOT / "reports" / "skeleton_11b.json"
REPORT_MD = ROOT / "reports" / "skeleton_11b.md"

# ----------------------------------------------------------------------------------------------------------------
# The skeleton's shape
# ----------------------------------------------------------------------------------------------------------------


from pipeline.mllama_shape import (ASPECT_RATIOS, CORPUS_WORDS, LLAMA3_SPECIALS, Size,  # noqa: E402,F401
                                   build_processor, corpus, full_11b_config, skeleton_config, special_ids)

PRESETS = {
    # The skeleton: every width of the 11B, 3 text layers (self, cross, self), 2 + 1 vision layers, 4 tiles.
    "full": Size(),
    # The QAT reduction (2 CPU processes in 24 GB): every matrix shape of the 11B except the vocabulary's:
    # vocabulary 16,384 instead of 128,256, text 1 layer (a cross-attention layer: q/k/v/o and MLP have the
    # self-attention layer's shapes), vision 1 local + 1 global layer, 1 tile (1,601 image tokens) instead of 4.
    "qat": Size(vocab_size=16384, text_layers=1, cross_attention_layers=[0], vision_layers=1,
                intermediate_layers_indices=[0, 0, 0, 0, 0], max_num_tiles=1),
    # For tests: tiny everything.
    "tiny": Size(vocab_size=1024, text_hidden=64, text_intermediate=128, text_heads=4, text_kv_heads=2,
                 vision_hidden=32, vision_intermediate=64, vision_heads=2, image_size=56, patch_size=14,
                 max_num_tiles=1),
}
PRESETS["tiny_qat"] = dataclasses.replace(PRESETS["tiny"], text_layers=1, cross_attention_layers=[0], vision_layers=1,
                                          intermediate_layers_indices=[0, 0, 0, 0, 0])

# ----------------------------------------------------------------------------------------------------------------
# Building the checkpoint
# ----------------------------------------------------------------------------------------------------------------

GATES = ("cross_attn_attn_gate", "cross_attn_mlp_gate", "gate_attn", "gate_ffn", ".gate")


def init_parameter(name: str, p: torch.Tensor, seed: int, pad_row: int | None) -> None:
    """Seeded in-place initialisation of one tensor (its own generator: the result does not depend on the order
    or on the other tensors). Norm weights 1, biases 0, tanh gates 1 (so the image reaches the text from the
    start), every matrix / embedding N(0, 0.02); the embedding's padding row 0 (as the 11B's)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    with torch.no_grad():
        if name.endswith(GATES):
            p.fill_(1.0)
        elif "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=g)
        if pad_row is not None and name.endswith("embed_tokens.weight"):
            p[pad_row].zero_()


def build(out: str | Path, s: Size, seed: int = 0, max_shard_size: str = "2GB") -> dict:
    """Write the skeleton to ``out`` like a hub checkpoint (``save_pretrained`` in bf16, sharded, with the
    processor and generation config). One bf16 copy of the weights is ever built: the model is made on the
    ``meta`` device, materialised empty in bf16 and filled tensor by tensor in place."""
    from transformers import GenerationConfig, MllamaForConditionalGeneration

    out = Path(out)
    config = skeleton_config(s)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = MllamaForConditionalGeneration(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    pad = config.text_config.pad_token_id
    for name, p in model.named_parameters():
        init_parameter(name, p, seed, pad)
    for name, b in model.named_buffers():        # the rotary frequencies: recomputed on load, but not garbage here
        if b.is_floating_point():
            b.zero_()
    model.generation_config = GenerationConfig(bos_token_id=config.text_config.bos_token_id,
                                               eos_token_id=config.text_config.eos_token_id,
                                               pad_token_id=config.text_config.pad_token_id,
                                               do_sample=True, temperature=0.6, top_p=0.9)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    processor = build_processor(s)
    processor.save_pretrained(str(out))
    n = sum(p.numel() for p in model.parameters())
    (out / "skeleton.json").write_text(json.dumps({"size": dataclasses.asdict(s), "seed": seed, "params": n,
                                                   "bpe_tokens": processor.n_trained_tokens}, indent=1))
    return {"params": n, "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors"))}


# ----------------------------------------------------------------------------------------------------------------
# Parameter counts (meta device)
# ----------------------------------------------------------------------------------------------------------------


def qat_memory(config, *, devices: int = 8, workload: Workload | None = None, compute_bytes: int = 2,
               teacher: str = "shard", checkpointing: bool = True, teacher_bytes: int = 2,
               counts: dict | None = None, strategy: str = "fsdp2", kl_cache_bytes: float = 0) -> dict:
    """Per-device bytes of one QAT step by term (``pipeline.memory_plan.qat_device``, the plan's model), with
    ``host_load``: the host RAM rank 0 needs to load the fp32 student and the teacher."""
    counts = counts or count_params(config)
    w = workload or Workload(micro_batch=4, seq=512, tiles=config.vision_config.max_num_tiles)
    parts = qat_device(config, counts, devices=devices, workload=w, compute_bytes=compute_bytes, strategy=strategy,
                       teacher=teacher, checkpointing=checkpointing, teacher_bytes=teacher_bytes,
                       kl_cache_bytes=kl_cache_bytes)
    P = counts["total"]
    return {"parts": parts, "total": sum(parts.values()), "host_load": P * (4 + teacher_bytes), "params": P,
            "workload": dataclasses.asdict(w), "devices": devices, "teacher": teacher, "checkpointing": checkpointing,
            "compute_bytes": compute_bytes, "vocab": config.text_config.vocab_size}


def step_memory(counts: dict, base: float, file_bytes: float | None = None) -> dict:
    """Predicted peak RSS (bytes) of the single-process steps: ``base`` (the interpreter, measured) plus
    ``pipeline.memory_plan.step_host``; ``build`` holds one bf16 copy (``save_pretrained`` writes its shards from
    the model's own tensors: the 2 GB shard once counted on top was measured not to be there)."""
    return {"build": base + 2 * counts["total"],
            **{k: base + v for k, v in step_host(counts, file_bytes).items()}}


def table_11b(devices: int = 8, batch: int = 128, grad_accum: int = 4, seq: int = 512) -> list[dict]:
    """The memory model's rows for the full 11B on ``devices`` GPUs: teacher sharded / replicated, with and
    without gradient checkpointing, bf16 compute."""
    config = full_11b_config()
    counts = count_params(config)
    w = Workload(micro_batch=batch // (devices * grad_accum), seq=seq, tiles=config.vision_config.max_num_tiles)
    rows = []
    for teacher in ("shard", "replicate"):
        for ckpt in (True, False):
            r = qat_memory(config, devices=devices, workload=w, teacher=teacher, checkpointing=ckpt, counts=counts)
            rows.append(r)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Measured steps (each in a fresh process)
# ----------------------------------------------------------------------------------------------------------------


def rss_kib(field_name: str = "VmHWM", pid: str = "self") -> int:
    return int(re.search(rf"{field_name}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5), so a phase's peak can be read alone."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class Phases:
    """Peak RSS per phase of one process: ``with phases("load"): ...``."""

    def __init__(self) -> None:
        self.records: dict[str, dict] = {}

    def __call__(self, name: str):
        phases = self

        class _Phase:
            def __enter__(self):
                reset_peak()
                self.t = time.perf_counter()
                self.start = rss_kib("VmRSS")

            def __exit__(self, *exc):
                phases.records[name] = {"seconds": round(time.perf_counter() - self.t, 2),
                                        "rss_start_gb": round(self.start * 1024 / GB, 3),
                                        "peak_rss_gb": round(rss_kib("VmHWM") * 1024 / GB, 3),
                                        "rss_end_gb": round(rss_kib("VmRSS") * 1024 / GB, 3)}
                return False

        return _Phase()


def test_image(tiles: int):
    """A deterministic picture whose aspect ratio uses ``tiles`` tiles (2 x 2 for 4)."""
    from PIL import Image, ImageDraw

    w, h = {1: (560, 560), 2: (1120, 560), 4: (1120, 1120)}.get(tiles, (560, 560))
    img = Image.new("RGB", (w, h), (230, 230, 250))
    d = ImageDraw.Draw(img)
    d.ellipse((w // 8, h // 8, w // 2, h // 2), fill=(200, 30, 30))
    d.rectangle((w // 2, h // 2, 7 * w // 8, 7 * h // 8), fill=(30, 30, 200))
    return img


def prompt_inputs(processor, tiles: int, text: str = "Describe the image briefly."):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(images=[[test_image(tiles)]], text=[prompt], add_special_tokens=False, return_tensors="pt")


def dirs(preset: str) -> dict[str, Path]:
    base = WORK / preset
    return {"model": base / "model", "states": base / "states.safetensors", "fit_report": base / "fit.json",
            "packed": base / "packed", "qat": base / "qat"}


def _step_build(preset: str, phases: Phases) -> dict:
    d = dirs(preset)
    import shutil
    shutil.rmtree(d["model"], ignore_errors=True)
    with phases("build"):
        out = build(d["model"], PRESETS[preset])
    return out


def _step_fit(preset: str, phases: Phases) -> dict:
    from pipeline import formats
    from pipeline.fit import fit_model

    d = dirs(preset)
    fmt = formats.get("s3d8")
    with phases("fit"):
        states, report = fit_model(fmt, str(d["model"]))
    fmt.save_states(d["states"], states)
    d["fit_report"].write_text(json.dumps(report["summary"], indent=1))
    return report["summary"]


def _step_pack(preset: str, phases: Phases) -> dict:
    import shutil

    from pipeline import formats
    from pipeline.checkpoint import CheckpointReader
    from pipeline.hf_write import write_model_dir
    from pipeline.models import load_config

    d = dirs(preset)
    fmt = formats.get("s3d8")
    states = fmt.load_states(d["states"])
    shutil.rmtree(d["packed"], ignore_errors=True)
    with phases("pack"):
        summary = write_model_dir(d["packed"], CheckpointReader(d["model"]), fmt, states, teacher_dir=d["model"],
                                  method="direct-cast", base_model="skeleton-11b (random)", teacher_name="skeleton-11b",
                                  metadata={"config": load_config(str(d["model"])).to_dict(), "method": "direct-cast",
                                            "source_model": "skeleton-11b"})
    return summary


def _packed_file(preset: str) -> Path:
    return dirs(preset)["packed"] / "model.safetensors"


def _step_load(preset: str, phases: Phases, decode: str, generate: int = 0) -> dict:
    from pipeline.models import load_processor
    from pipeline.packed import load_packed_model

    d = dirs(preset)
    with phases("load"):
        model = load_packed_model(_packed_file(preset), decode=decode)
    out: dict = {"decode": decode}
    if generate:
        processor = load_processor(str(d["model"]))
        tiles = PRESETS[preset].max_num_tiles
        inputs = prompt_inputs(processor, tiles)
        out["prompt_tokens"] = int(inputs["input_ids"].shape[1])
        vc = model.config.vision_config
        out["image_tokens"] = tiles * ((vc.image_size // vc.patch_size) ** 2 + 1)
        with torch.inference_mode(), phases("forward"):
            logits = model(**inputs).logits
        out["logits_finite"] = bool(torch.isfinite(logits).all())
        out["logits_shape"] = list(logits.shape)
        eos = model.generation_config.eos_token_id
        with torch.inference_mode(), phases("generate"):
            gen = model.generate(**inputs, max_new_tokens=generate, min_new_tokens=generate, do_sample=False,
                                 pad_token_id=processor.tokenizer.pad_token_id, eos_token_id=eos)
        out["generated"] = gen[0, inputs["input_ids"].shape[1]:].tolist()
        out["generate_tokens_per_s"] = round(generate / phases.records["generate"]["seconds"], 4)
    return out


def _examples(processor, model_dir: Path, n: int, response_len: int, seed: int = 0):
    """Training sequences: the chat prompt with an image, and a random "teacher response" of BPE tokens."""
    import random

    from pipeline.answers import Example

    rng = random.Random(seed)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids = tuple(processor.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    eot = processor.tokenizer.convert_tokens_to_ids("<|eot_id|>")
    n_bpe = int(json.loads((Path(model_dir) / "skeleton.json").read_text())["bpe_tokens"])
    return [Example(k, f"toy:{seed}:{k}", ids, tuple(rng.randrange(1, n_bpe) for _ in range(response_len)) + (eot,))
            for k in range(n)]


def derive_states(source: str, target: str) -> dict:
    """The S3D8 states of preset ``target`` taken from those fitted on ``source`` (same checkpoint names: the
    reduced skeleton's layers are a subset of the full one's; an S3D8 state is a [32, 3] table, whatever the
    matrix's shape), so the reduction needs no second fit."""
    from pipeline import formats
    from pipeline.models import meta_model, quantised_weight_names

    fmt = formats.get("s3d8")
    states = fmt.load_states(dirs(source)["states"])
    names = quantised_weight_names(meta_model(skeleton_config(PRESETS[target])))
    cross = PRESETS[source].cross_attention_layers[0]
    out = {}
    for saved in names.values():
        key = saved.removesuffix(".weight")
        if key not in states:      # a text layer of another kind at this index: the source's cross layer
            key = re.sub(r"(language_model\.(?:model\.)?layers\.)\d+\.", rf"\g<1>{cross}.", key)
        out[saved.removesuffix(".weight")] = states[key]
    fmt.save_states(dirs(target)["states"], out)
    return {"matrices": len(out), "from": source}


QAT_STEPS = 3
QAT_SEQ = 128


def _qat_rank(preset: str, teacher: str, ckpt: bool, steps: int, seq: int) -> None:
    """One torchrun rank of the skeleton's QAT run (FSDP2 over gloo, fp32 compute)."""
    import shutil

    import pipeline.qat.train as qt
    from pipeline.qat.engines import FSDP2Engine
    import pipeline.toy  # noqa: F401  (the toy image pool)
    from pipeline import formats
    from pipeline.processes import LaunchParams
    from pipeline.params import defaults
    from pipeline.models import load_processor
    from pipeline.stage import set_threads

    set_threads(1)
    d = dirs(preset)
    rank = int(os.environ.get("RANK", "0"))
    fmt = formats.get("s3d8")
    states = fmt.load_states(d["states"])
    processor = load_processor(str(d["model"]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    examples = _examples(processor, d["model"], 4 * world, seq // 2)
    phases = Phases()
    # Phase boundaries through the engine's own calls (wrapping, not changing, pipeline.qat.engines.FSDP2Engine).
    engine = FSDP2Engine
    orig = {k: getattr(engine, k) for k in ("student", "save_student")}
    state = {"cm": None}

    def enter(name):
        if state["cm"] is not None:
            state["cm"].__exit__(None, None, None)
        state["cm"] = phases(name)
        state["cm"].__enter__()

    def student_hook(self, *args):
        # rank 0 loads the fp32 student whole; every rank builds it on meta, shards it and receives its shards
        enter("load_student")
        r = orig["student"](self, *args)
        enter("train")                         # optimizer, steps (forward, backward, AdamW)
        return r

    def save_hook(self, student, processor, out_dir, *rest):
        enter("save_student")
        return orig["save_student"](self, student, processor, out_dir, *rest)

    engine.student, engine.save_student = student_hook, save_hook
    if rank == 0:
        shutil.rmtree(d["qat"], ignore_errors=True)
    launch = defaults(LaunchParams, "launch", num_processes=world, backend="gloo", strategy="fsdp2",
                      compute_dtype="float32", gradient_checkpointing=ckpt, teacher=teacher)
    p = defaults(qt.QATParams, "qat", steps=steps, batch_size=2 * world, grad_accum=1, max_seq_len=seq,
                 checkpoint_every=1000, init="teacher", threads=1)
    enter("load_teacher")
    t0 = time.perf_counter()
    summary = qt.train(fmt, states, str(d["model"]), "bfloat16", examples, p, out_dir=d["qat"] / "student",
                       checkpoint=d["qat"] / f"ckpt-{teacher}.safetensors", live_dir=d["qat"] / "live",
                       fingerprint=f"skeleton-{preset}-{teacher}-{ckpt}", launch=launch)
    state["cm"].__exit__(None, None, None)
    seconds = time.perf_counter() - t0
    train = phases.records.get("train", {})
    out = {"rank": rank, "world": world, "phases": phases.records, "summary": summary,
           "seconds": round(seconds, 1), "steps": steps,
           "seconds_per_step": round(train.get("seconds", float("nan")) / steps, 2),
           "peak_rss_gb": round(max(r["peak_rss_gb"] for r in phases.records.values()), 3)}
    Path(os.environ["SKELETON_OUT"] + f".rank{rank}").write_text(json.dumps(out, indent=1))


def run_step(argv: list[str]) -> None:
    """``step NAME PRESET``: one measured step in this (fresh) process; its result as JSON in $SKELETON_OUT."""
    name, preset = argv[0], argv[1]
    import transformers  # noqa: F401  (the base RSS includes the libraries)

    phases = Phases()
    base = rss_kib("VmRSS") * 1024 / GB
    t0 = time.perf_counter()
    if name == "build":
        result = _step_build(preset, phases)
    elif name == "fit":
        result = _step_fit(preset, phases)
    elif name == "pack":
        result = _step_pack(preset, phases)
    elif name in ("load_lazy", "load_eager"):
        result = _step_load(preset, phases, name.split("_")[1])
    elif name in ("generate_lazy", "generate_eager"):
        result = _step_load(preset, phases, name.split("_")[1], generate=int(argv[2]) if len(argv) > 2 else 3)
    else:
        raise SystemExit(f"unknown step {name!r}")
    out = {"step": name, "preset": preset, "base_rss_gb": round(base, 3), "seconds": round(time.perf_counter() - t0, 1),
           "phases": phases.records, "result": result,
           "peak_rss_gb": round(max([rss_kib("VmHWM") * 1024 / GB] + [r["peak_rss_gb"] for r in phases.records.values()]), 3)}
    Path(os.environ["SKELETON_OUT"]).write_text(json.dumps(out, indent=1, default=str))


def measure(name: str, preset: str, *extra: str, timeout: int = 3600) -> dict:
    """Run one step in a fresh subprocess and return its record (plus the child's exit status)."""
    out = WORK / preset / f"step-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    env = {**os.environ, "SKELETON_OUT": str(out), "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "step", name, preset, *extra], env=env, cwd=ROOT,
                          timeout=timeout, capture_output=True, text=True)
    if proc.returncode or not out.exists():
        return {"step": name, "preset": preset, "error": proc.stderr[-3000:], "returncode": proc.returncode,
                "seconds": round(time.perf_counter() - t0, 1)}
    return json.loads(out.read_text())


def measure_qat(preset: str = "qat", teacher: str = "shard", ckpt: bool = True, processes: int = 2,
                steps: int = QAT_STEPS, seq: int = QAT_SEQ, timeout: int = 3600) -> dict:
    out = WORK / preset / f"step-qat-{teacher}-{'ckpt' if ckpt else 'nockpt'}.json"
    for old in out.parent.glob(out.name + ".rank*"):
        old.unlink()
    env = {**os.environ, "SKELETON_OUT": str(out), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           str(processes), __file__, "qat-rank", preset, teacher, str(int(ckpt)), str(steps), str(seq)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
    ranks = [json.loads(f.read_text()) for f in sorted(out.parent.glob(out.name + ".rank*"))]
    rec = {"step": "qat", "preset": preset, "teacher": teacher, "gradient_checkpointing": ckpt,
           "processes": processes, "steps": steps, "seq": seq, "ranks": ranks,
           "seconds": round(time.perf_counter() - t0, 1), "returncode": proc.returncode}
    if proc.returncode or len(ranks) != processes:
        rec["error"] = proc.stderr[-4000:]
    else:
        rec["peak_rss_gb_per_rank"] = [r["peak_rss_gb"] for r in ranks]
        rec["peak_rss_gb_sum"] = round(sum(rec["peak_rss_gb_per_rank"]), 3)
    out.write_text(json.dumps(rec, indent=1))
    return rec


# ----------------------------------------------------------------------------------------------------------------
# Predicted vs measured, and the report
# ----------------------------------------------------------------------------------------------------------------


def base_rss_gb() -> float:
    """RSS of a fresh process after importing torch, transformers and the pipeline (measured here)."""
    code = ("import re,pathlib,torch,transformers,pipeline,pipeline.packed,pipeline.fit,pipeline.qat.train;"
            "print(int(re.search(r'VmHWM:\\s+(\\d+)',pathlib.Path('/proc/self/status').read_text()).group(1)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return int(out.stdout.strip()) * 1024 / GB


def check_qat(rec: dict, counts: dict, base: float) -> dict:
    """The memory model's prediction for the measured skeleton QAT run (per rank, CPU: fp32 compute) vs the
    measured per-phase peaks, also as bytes per parameter above the base RSS."""
    cfg = skeleton_config(PRESETS[rec["preset"]])
    P = counts["total"]
    world = rec["processes"]
    w = Workload(micro_batch=1, seq=rec["seq"], tiles=cfg.vision_config.max_num_tiles)
    model = qat_memory(cfg, devices=world, workload=w, compute_bytes=4, teacher=rec["teacher"],
                       checkpointing=rec["gradient_checkpointing"], counts=counts)
    rank0 = rec["ranks"][0]["phases"]
    teacher_full = 2 * P
    # outside a step the sharded teacher holds its shard only (no units gathered)
    teacher_rest = teacher_full / world if rec["teacher"] == "shard" else teacher_full
    predicted = {
        # rank 0 reads the whole teacher and, on the CPU, keeps its own shard beside it in host memory
        "load_teacher": base * GB + teacher_full + (teacher_rest if rec["teacher"] == "shard" else 0),
        # rank 0: the whole fp32 student it loads (the other ranks never hold it) and its own shards filled from it
        "load_student": base * GB + teacher_rest + 4 * P + 4 * P / world,
        "train": base * GB + model["total"],
        # rank 0 gathers the whole student, and save_pretrained's safetensors serialiser copies it to bytes
        "save_student": base * GB + teacher_rest + 16 * P / world + 4 * P + 4 * P,
    }
    rows = []
    for phase, pred in predicted.items():
        meas = rank0.get(phase, {}).get("peak_rss_gb")
        if meas is None:
            continue
        rows.append({"phase": phase, "measured_gb": meas, "predicted_gb": round(pred / GB, 3),
                     "measured_bytes_per_param": round((meas - base) * GB / P, 2),
                     "predicted_bytes_per_param": round(pred / P - base * GB / P, 2),
                     "ratio": round(meas / (pred / GB), 3)})
    return {"params": P, "base_gb": round(base, 3), "model_parts_gb": {k: round(v / GB, 3) for k, v in model["parts"].items()},
            "rows": rows}


def check_steps(steps: dict, counts: dict, base: float) -> list[dict]:
    file_bytes = None
    pack = steps.get("pack", {}).get("result", {})
    if "file_bytes" in pack:
        file_bytes = pack["file_bytes"]
    pred = step_memory(counts, base * GB, file_bytes)
    rows = []
    for name, key in (("build", "build"), ("fit", "fit"), ("pack", "pack"), ("load_lazy", "load_lazy"),
                      ("load_eager", "load_eager")):
        rec = steps.get(name)
        if not rec or "peak_rss_gb" not in rec:
            continue
        rows.append({"step": name, "measured_gb": rec["peak_rss_gb"], "predicted_gb": round(pred[key] / GB, 3),
                     "ratio": round(rec["peak_rss_gb"] / (pred[key] / GB), 3)})
    return rows


def write_report(data: dict) -> None:
    REPORT_JSON.write_text(json.dumps(data, indent=1, default=str) + "\n")
    REPORT_MD.write_text(markdown(data))


def _gb(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(data: dict) -> str:
    L = ["# The 11B-shaped skeleton: every step at full width, and a memory model for the 11B", "",
         "Written by `benchmarks/skeleton_11b.py all` (numbers: `reports/skeleton_11b.json`). "
         f"Machine: {data.get('machine', '')}.", ""]
    sk = data.get("skeleton", {})
    if sk:
        L += ["## The skeleton", "", f"- full: {sk['full']['description']}",
              f"- qat (the reduction QAT ran on): {sk['qat']['description']}", ""]
        L += ["| preset | parameters | quantised | largest matrix | checkpoint (bf16) |", "|---|---:|---:|---:|---:|"]
        for k in ("full", "qat"):
            c = sk[k]["counts"]
            L.append(f"| {k} | {c['total'] / 1e9:.3f} B | {c['quantised'] / 1e9:.3f} B | {c['largest_matrix'] / 1e6:.1f} M | "
                     f"{_gb(sk[k].get('checkpoint_gb'))} GB |")
        L.append("")
    steps = data.get("steps", {})
    if steps:
        L += ["## Measured steps (peak RSS of a fresh process per step)", "",
              f"Base RSS (python + torch + transformers + pipeline imported): {_gb(data.get('base_rss_gb'))} GB.", "",
              "| step | preset | wall s | peak RSS GB | phases (peak GB / s) | result |", "|---|---|---:|---:|---|---|"]
        for name, rec in steps.items():
            if "error" in rec:
                L.append(f"| {name} | {rec.get('preset')} | {rec.get('seconds')} | - | failed | "
                         f"`{rec['error'].strip().splitlines()[-1][:120] if rec['error'].strip() else rec.get('returncode')}` |")
                continue
            if name.startswith("qat"):
                ph = rec["ranks"][0]["phases"]
                phase_s = "; ".join(f"{k} {v['peak_rss_gb']:.2f}/{v['seconds']:.0f}" for k, v in ph.items())
                kl = [r.get("summary", {}) for r in rec["ranks"] if r.get("summary")]
                res = f"{rec['steps']} steps, {rec['ranks'][0]['seconds_per_step']} s/step"
                if kl:
                    res += f", KL first {kl[0].get('kl_first', float('nan')):.3f}"
                L.append(f"| {name} | {rec['preset']} | {rec['seconds']} | {' + '.join(_gb(x) for x in rec['peak_rss_gb_per_rank'])} "
                         f"(ranks) | rank 0: {phase_s} | {res} |")
                continue
            phase_s = "; ".join(f"{k} {v['peak_rss_gb']:.2f}/{v['seconds']:.0f}" for k, v in rec["phases"].items())
            r = rec.get("result", {})
            res = ""
            if name == "fit":
                res = f"{r.get('matrices')} matrices, rel. RMSE {r.get('rel_rmse', 0):.4f}, {r.get('bits_per_param', 0):.3f} bit"
            elif name == "pack":
                res = f"{r.get('file_bytes', 0) / GB:.3f} GB, {r.get('bits_per_param_actual', 0):.3f} bit actual"
            elif name.startswith("generate"):
                res = (f"{r.get('prompt_tokens')} prompt + {r.get('image_tokens')} image tokens; logits finite "
                       f"{r.get('logits_finite')}; {len(r.get('generated', []))} tokens at {r.get('generate_tokens_per_s')} tok/s")
            elif name.startswith("build"):
                res = f"{r.get('params', 0) / 1e9:.3f} B params, {r.get('bytes', 0) / GB:.2f} GB"
            L.append(f"| {name} | {rec['preset']} | {rec['seconds']} | {_gb(rec['peak_rss_gb'])} | {phase_s} | {res} |")
        L.append("")
    chk = data.get("check", {})
    if chk.get("steps"):
        L += ["## The memory model against the skeleton", "", "Single-process steps (`step_memory`):", "",
              "| step | measured GB | predicted GB | measured / predicted |", "|---|---:|---:|---:|"]
        for r in chk["steps"]:
            L.append(f"| {r['step']} | {r['measured_gb']:.2f} | {r['predicted_gb']:.2f} | {r['ratio']:.2f} |")
        L.append("")
    for key, rec in (chk.get("qat") or {}).items():
        L += [f"QAT `{key}`, rank 0, per phase (`qat_memory` with fp32 compute, 2 ranks; bytes per parameter above "
              f"the base RSS, P = {rec['params'] / 1e6:.0f} M):", "",
              "| phase | measured GB | predicted GB | measured B/param | predicted B/param | ratio |",
              "|---|---:|---:|---:|---:|---:|"]
        for r in rec["rows"]:
            L.append(f"| {r['phase']} | {r['measured_gb']:.2f} | {r['predicted_gb']:.2f} | {r['measured_bytes_per_param']:.2f} | "
                     f"{r['predicted_bytes_per_param']:.2f} | {r['ratio']:.2f} |")
        L.append("")
        L.append("Predicted train-phase parts (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in rec["model_parts_gb"].items()))
        L.append("")
    m = data.get("model_11b")
    if m:
        c = m["counts"]
        L += ["## The memory model: Llama 3.2 11B Vision on 8 x 80 GB GPUs, FSDP2, bf16 compute", "",
              f"Parameters (MllamaConfig defaults on `meta`, 560-pixel tiles): {c['total'] / 1e9:.3f} B, of which "
              f"{c['quantised'] / 1e9:.3f} B quantised in {c['quantised_matrices']} matrices; largest FSDP unit "
              f"{c['largest_unit'] / 1e6:.0f} M (the token embedding; a text decoder layer is {c['text_self_layer'] / 1e6:.0f} M), embedding {c['embed'] / 1e6:.0f} M, "
              f"lm_head {c['lm_head'] / 1e6:.0f} M. Workload: batch 128 = 8 GPUs x micro-batch "
              f"{m['rows'][0]['workload']['micro_batch']} x grad_accum 4, {m['rows'][0]['workload']['seq']} text tokens "
              f"+ {m['rows'][0]['workload']['tiles']} tiles x 1601 = 6404 image tokens a sequence.", "",
              "| GB per GPU | " + " | ".join(f"teacher {r['teacher']}, {'ckpt' if r['checkpointing'] else 'no ckpt'}"
                                          for r in m["rows"]) + " |",
              "|---|" + "---:|" * len(m["rows"])]
        for part in m["rows"][0]["parts"]:
            L.append(f"| {part} | " + " | ".join(f"{r['parts'][part] / GB:.1f}" for r in m["rows"]) + " |")
        L.append("| **total** | " + " | ".join(f"**{r['total'] / GB:.1f}**" for r in m["rows"]) + " |")
        L.append("| fits 80 GB | " + " | ".join("yes" if r["total"] < 76 * GB else "no" for r in m["rows"]) + " |")
        L.append(f"| host RAM of rank 0 at load (fp32 student + whole teacher; other ranks hold neither when sharded) | " + " | ".join(f"{r['host_load'] / GB:.0f}" for r in m["rows"]) + " |")
        L.append("")
        s = m.get("single_steps")
        if s:
            ratios = {r["step"]: r["ratio"] for r in chk.get("steps", [])}
            L += ["Single-process steps at 11B (host RAM, `step_memory`; calibrated = predicted x the skeleton's "
                  "measured / predicted ratio; fit and pack stream one matrix at a time and the skeleton's largest "
                  "matrix is the 11B's, the token embedding, so their peaks do not grow with depth):", "",
                  "| step | predicted GB | calibrated GB |", "|---|---:|---:|"]
            for k, v in s.items():
                cal = f"{v / GB * ratios[k]:.1f}" if k in ratios else "-"
                L.append(f"| {k} | {v / GB:.1f} | {cal} |")
            L.append("")
            host = m["rows"][0]["host_load"]
            teacher_gb = 2 * m["rows"][0]["params"] / GB
            L += [f"Host RAM at QAT start: rank 0 reads the fp32 student and, with `launch.teacher: shard`, the bf16 "
                  f"teacher, and fills the other ranks' shards from them ({host / GB:.0f} GB on rank 0, none of it on "
                  f"the others, whose modules are built on `meta`); with `launch.teacher: replicate` every rank also "
                  f"loads the whole teacher ({teacher_gb:.0f} GB each, {8 * teacher_gb:.0f} GB for a node's 8 ranks).", ""]
    for note in data.get("notes", []):
        L.append(f"- {note}")
    return "\n".join(L) + "\n"


def describe(s: Size) -> str:
    return (f"vocab {s.vocab_size} (+ image token), text {s.text_layers} layers (cross-attention at "
            f"{s.cross_attention_layers}) of width {s.text_hidden} / MLP {s.text_intermediate}, "
            f"{s.text_heads} / {s.text_kv_heads} heads; vision {s.vision_layers} + {s.vision_global_layers} layers "
            f"of width {s.vision_hidden} / MLP {s.vision_intermediate}, {s.image_size} px, patch {s.patch_size}, "
            f"{s.max_num_tiles} tile(s) = {s.max_num_tiles * ((s.image_size // s.patch_size) ** 2 + 1)} image tokens")


def model_11b(base_gb: float = 0.3) -> dict:
    config = full_11b_config()
    counts = count_params(config)
    rows = table_11b()
    base = base_gb * GB
    return {"counts": counts, "rows": rows, "single_steps": step_memory(counts, base)}


STEPS = ["build", "fit", "pack", "load_lazy", "load_eager", "generate_lazy", "generate_eager"]


def cpu_name() -> str:
    """The CPU's model name and its SIMD flags that matter here, from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU unknown"
    name = re.search(r"model name\s*:\s*(.*)", info)
    flags = set((re.search(r"flags\s*:\s*(.*)", info) or re.search(r"Features\s*:\s*(.*)", info)).group(1).split())
    simd = [f for f in ("avx2", "avx512f", "avx512vbmi", "avx512_vnni", "amx_tile", "asimddp", "i8mm") if f in flags]
    return f"{name.group(1).strip() if name else 'CPU'} ({', '.join(simd) or 'no AVX2'})"


def run_all(only: list[str] | None = None, gen_tokens: int = 3) -> dict:
    data = json.loads(REPORT_JSON.read_text()) if REPORT_JSON.exists() else {}
    data.setdefault("steps", {})
    import platform
    data["machine"] = (f"{cpu_name()}, {os.cpu_count()} cores, "
                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GB:.0f} GB RAM, "
                       f"{platform.machine()}, torch {torch.__version__}, no GPU")
    data["base_rss_gb"] = round(base_rss_gb(), 3)
    plan = only or STEPS + ["build_qat", "states_qat", "qat"]
    for name in plan:
        print(f"[skeleton] {name} ...", flush=True)
        if name == "build_qat":
            rec = measure("build", "qat")
        elif name == "states_qat":
            data["states_qat"] = derive_states("full", "qat")
            continue
        elif name == "qat":
            rec = measure_qat("qat", teacher="shard", ckpt=True)
            data["steps"]["qat_shard_ckpt"] = rec
            print(json.dumps({k: v for k, v in rec.items() if k != "ranks"}, default=str)[:2000], flush=True)
            write_report(finish(data))
            continue
        elif name.startswith("qat_"):          # qat_<teacher>_<ckpt|nockpt>
            _, teacher, ck = name.split("_")
            rec = measure_qat("qat", teacher=teacher, ckpt=ck == "ckpt")
        elif name.startswith("generate"):
            rec = measure(name, "full", str(gen_tokens))
        else:
            rec = measure(name, "full")
        data["steps"][name] = rec
        print(json.dumps({k: v for k, v in rec.items() if k != "ranks"}, default=str)[:1500], flush=True)
        write_report(finish(data))
    return finish(data)


NOTES = [
    "Image tokens: Mllama's vision encoder runs 4 tiles x 1,608 patches (1,601 padded to a multiple of 8) = 6,432 "
    "positions, and the language model cross-attends to 4 x 1,601 = 6,404 image tokens a picture; 7,680 is the "
    "width of the vision output (1280 x (1 final + 5 intermediate layers)), the projector's input, not a token count.",
    "Processor: the toy builder cannot be reused (its vocabulary is a BPE trainer's target, never reached by a small "
    "corpus, and its specials sit at ids 0-10), so `build_processor` trains a ~1k-token byte-level BPE with the Llama 3 "
    "pre-tokenizer, pads the vocabulary with unreachable filler tokens, puts the 256 Llama 3 specials at "
    "128000-128255 and `<|image|>` at 128256; Mllama's image processor at 560 px x 4 tiles; the toy's chat template.",
    "Weights: built on `meta`, materialised empty in bf16 and filled in place tensor by tensor (seeded per name: "
    "N(0, 0.02), norms 1, tanh gates 1, the padding row 0), then `save_pretrained` in 2 GB shards: one bf16 copy.",
    "Pack: a direct cast with the format's own absmax encoder (`fmt.pack`) through `write_model_dir` (HF directory, "
    "config in the metadata): the encoder's peak, not the pack-safetensors stage's (which now copies stage "
    "direct-cast's packed files). Its peak, at the token embedding: the embedding's bf16 pages mapped by safetensors "
    "(RssFile, 2 B a weight), its fp32 copy and its packed bytes. `CheckpointReader.get` opens a handle per tensor, "
    "so a tensor's pages leave the process with it (a cached handle once kept every page read: 2 GB at the peak, "
    "the whole checkpoint by the end), and the encoder's finiteness check reads min and max instead of a full-size "
    "mask (that mask's temporaries were 3.4 GB at the embedding).",
    "QAT ran on the reduction `qat` (2 CPU processes, gloo, FSDP2, fp32 compute, teacher sharded, gradient "
    "checkpointing, 3 steps of 2 sequences of 128 tokens): every 11B matrix shape except the vocabulary's "
    "(16,384 rows instead of 128,256), 1 text layer (cross-attention), 1 + 1 vision layers, 1 tile. The full "
    "skeleton does not fit two ranks in 24 GB: the measured train phase is ~23 B/param a rank (the fake-quantised "
    "units gathered in fp32 and the fp32 gradients reduce-scattered each micro-batch). Its S3D8 tables are the full "
    "skeleton's (same checkpoint names; an S3D8 state is a 32 x 3 table whatever the matrix's shape).",
    "Lazy vs eager: both generate the same tokens from the same logits path; lazy keeps the model at ~1 GB "
    "(the 0.63 GB file) and its forward peaks near 3 GB (each packed weight decoded in row blocks, lm_head "
    "included); eager holds its ~8 GB of decoded weights and peaks at load, where every weight is decoded.",
    "The memory model's activation terms are estimates (element counts per token and layer, SDPA without stored "
    "attention probabilities); the parameter terms are exact byte counts. With checkpointing the unit being "
    "recomputed holds its fake-quantised weights for its backward (counted); the train ratio left above 1 is the "
    "fake-quant's transient temporaries and allocator slack. At save, safetensors' serialiser copies rank 0's "
    "gathered fp32 student to bytes (counted: 8 B a parameter on rank 0's host).",
]


def finish(data: dict) -> dict:
    data["notes"] = NOTES
    data["skeleton"] = {}
    for k in ("full", "qat"):
        counts = count_params(skeleton_config(PRESETS[k]))
        ck = sum(f.stat().st_size for f in dirs(k)["model"].glob("*.safetensors")) / GB if dirs(k)["model"].exists() else None
        data["skeleton"][k] = {"size": dataclasses.asdict(PRESETS[k]), "description": describe(PRESETS[k]),
                               "counts": counts, "checkpoint_gb": ck}
    base = data.get("base_rss_gb", 0.6)
    data["check"] = {"steps": check_steps(data["steps"], data["skeleton"]["full"]["counts"], base), "qat": {}}
    for key, rec in data["steps"].items():
        if key.startswith("qat") and "ranks" in rec and "error" not in rec:
            data["check"]["qat"][key] = check_qat(rec, data["skeleton"]["qat"]["counts"], base)
    data["model_11b"] = model_11b(base)
    return data


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["step"]:
        run_step(argv[1:])
        return
    if argv[:1] == ["qat-rank"]:
        preset, teacher, ckpt, steps, seq = argv[1], argv[2], argv[3] == "1", int(argv[4]), int(argv[5])
        _qat_rank(preset, teacher, ckpt, steps, seq)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all", help="run every step (or --only some) and write the reports")
    a.add_argument("--only", nargs="*", help=f"steps among {STEPS + ['build_qat', 'states_qat', 'qat', 'qat_replicate_ckpt', 'qat_shard_nockpt']}")
    a.add_argument("--tokens", type=int, default=3)
    sub.add_parser("model", help="print the 11B memory model")
    sub.add_parser("report", help="rewrite the reports from reports/skeleton_11b.json")
    args = parser.parse_args(argv)
    if args.cmd == "all":
        write_report(run_all(args.only, args.tokens))
    elif args.cmd == "model":
        m = model_11b()
        for r in m["rows"]:
            print(f"teacher {r['teacher']:9s} ckpt {r['checkpointing']!s:5s} total {r['total'] / GB:7.1f} GB  " +
                  "  ".join(f"{k} {v / GB:.1f}" for k, v in r["parts"].items()))
    elif args.cmd == "report":
        write_report(finish(json.loads(REPORT_JSON.read_text())))


if __name__ == "__main__":
    main()
