"""An "11B-shaped" skeleton of Llama 3.2 11B Vision, run through every pipeline step, with a memory model.

The skeleton is a seeded, randomly initialised ``MllamaForConditionalGeneration`` with the 11B model's widths
(text hidden 4096, MLP 14336, vocabulary 128,256 + the image token, 32 query / 8 KV heads; vision width 1280,
MLP 5120, 560-pixel tiles of 14-pixel patches, 4 tiles: 4 x 1601 = 6,404 image tokens a picture, 7680-wide
vision output) and few layers (text: 2 self-attention + 1 cross-attention; vision: 2 local + 1 global). It is
saved like a hub checkpoint (``save_pretrained``, bf16, processor, generation config) and then fitted, packed,
loaded (lazy and eager), run (one image + prompt, a few generated tokens) and trained (QAT, 2 processes, FSDP2),
each step in a fresh subprocess whose peak RSS (VmHWM) is recorded. The command line and the report:
:mod:`pipeline.bench.skeleton_11b` (``python -m pipeline.bench.skeleton_11b all``).

The memory model (:func:`qat_memory`, :func:`step_memory`) extrapolates each step to the full 11B on 8 GPUs
with FSDP2 from parameter counts taken from ``MllamaConfig`` on the ``meta`` device (:func:`count_params`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import torch  # noqa: E402

from pipeline.launch.memory_plan import GB, Workload, count_params, qat_device, step_host  # noqa: E402

WORK = ROOT / "checkpoints" / "skeleton-11b"      # ignored by git (checkpoints/), outside every DVC output
REPORT_JSON = ROOT / "reports" / "skeleton_11b.json"
REPORT_MD = ROOT / "reports" / "skeleton_11b.md"

# ----------------------------------------------------------------------------------------------------------------
# The skeleton's shape
# ----------------------------------------------------------------------------------------------------------------


from pipeline.synthetic.shape import (ASPECT_RATIOS, CORPUS_WORDS, LLAMA3_SPECIALS, Size,  # noqa: E402,F401
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
    """Per-device bytes of one QAT step by term (``pipeline.launch.memory_plan.qat_device``, the plan's model), with
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
    ``pipeline.launch.memory_plan.step_host``; ``build`` holds one bf16 copy (``save_pretrained`` writes its shards from
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
    from pipeline.cast.fit import fit_model

    d = dirs(preset)
    fmt = formats.get(formats.SUBJECT)
    with phases("fit"):
        states, report = fit_model(fmt, str(d["model"]))
    fmt.save_states(d["states"], states)
    d["fit_report"].write_text(json.dumps(report["summary"], indent=1))
    return report["summary"]


def _step_pack(preset: str, phases: Phases) -> dict:
    import shutil

    from pipeline import formats
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.hf.write import write_model_dir
    from pipeline.models import load_config

    d = dirs(preset)
    fmt = formats.get(formats.SUBJECT)
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
    from pipeline.packed.file import load_packed_model

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

    from pipeline.teacher.answers import Example

    rng = random.Random(seed)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids = tuple(processor.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    eot = processor.tokenizer.convert_tokens_to_ids("<|eot_id|>")
    n_bpe = int(json.loads((Path(model_dir) / "skeleton.json").read_text())["bpe_tokens"])
    return [Example(k, f"toy:{seed}:{k}", ids, tuple(rng.randrange(1, n_bpe) for _ in range(response_len)) + (eot,))
            for k in range(n)]


QAT_STEPS = 3
QAT_SEQ = 128


def _qat_rank(preset: str, teacher: str, ckpt: bool, steps: int, seq: int) -> None:
    """One torchrun rank of the skeleton's QAT run (FSDP2 over gloo, fp32 compute)."""
    import shutil

    import pipeline.qat.train as qt
    from pipeline.qat.engines import FSDP2Engine
    import pipeline.toy  # noqa: F401  (the toy image pool)
    from pipeline import formats
    from pipeline.launch.processes import LaunchParams
    from pipeline.params import defaults
    from pipeline.models import load_processor
    from pipeline.stage import set_threads

    set_threads(1)
    d = dirs(preset)
    rank = int(os.environ.get("RANK", "0"))
    fmt = formats.get(formats.SUBJECT)
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
    proc = subprocess.run([sys.executable, "-m", "pipeline.bench.skeleton_11b", "step", name, preset, *extra],
                          env=env, cwd=ROOT,
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
           str(processes), "-m", "pipeline.bench.skeleton_11b", "qat-rank", preset, teacher, str(int(ckpt)),
           str(steps), str(seq)]
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


def main(argv: list[str]) -> None:
    """``step NAME PRESET ...`` and ``qat-rank ...``: what :func:`measure` and :func:`measure_qat` start in a
    subprocess (through ``python -m pipeline.bench.skeleton_11b``)."""
    if argv[:1] == ["step"]:
        run_step(argv[1:])
    else:
        preset, teacher, ckpt, steps, seq = argv[1], argv[2], argv[3] == "1", int(argv[4]), int(argv[5])
        _qat_rank(preset, teacher, ckpt, steps, seq)
