"""The memory and disk a run needs, stage by stage, before it starts: ``python -m pipeline.launch plan``.

For the current ``params.yaml`` (its ``launch`` section included) and the teacher's config, :func:`plan` lists for
each stage and phase the bytes each device (a GPU, or a process's share of host RAM on a CPU run) and each node's
host RAM hold, term by term: the teacher, the student's fp32 masters, gradients and AdamW moments (sharded by FSDP2,
whole under DDP), the gathered units, the fake-quantised weights kept for the backward, activations (with or
without gradient checkpointing), the logits, the cached teacher logits, the KV cache of generation, the float64
Hessian sums of calibration, the direct cast's largest layer, the fit's and the pack's working set. :func:`check`
compares them with the memory there is and names every term of a phase that does not fit;
``pipeline.launch`` runs that check before it starts a stage (``S3D8_MEMORY_CHECK=0`` skips it).

Disk (:func:`disk_terms`): what each stage leaves (the bf16 teacher, the answers' token ids, calibration's fp32
``X^T X``, each format's casts, fp32 students and packed models) and DVC's copy of it in its cache, and what
qat-train holds only while it runs: its checkpoints (fp32 masters and AdamW's two moments, two while the next is
written). :func:`check_disk` adds them up in ``dvc repro``'s order against the free space of the project and of
DVC's cache (:func:`disk_available`), and names the first phase that does not fit.

The terms are estimates from parameter counts on the ``meta`` device (:func:`count_params`); the 11B-shaped
skeleton (``pipeline/bench/skeleton_11b.py``) measures the same phases on CPU and reports each next to its prediction
(``reports/skeleton_11b.md``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9


# --- parameter counts ---------------------------------------------------------------------------------------------

def count_params(config) -> dict:
    """Parameter counts of the model ``config`` describes (Mllama or text-only Llama), built on the ``meta`` device:
    total, quantised (the recipe's Linear / Embedding weights), the largest FSDP2 unit and quantised matrix, the
    text layers (self- and cross-attention), the vision layers, and what the memory model needs."""
    from pipeline.models import meta_model
    from pipeline.models import sharding_units
    from pipeline.recipe import quantised_modules

    model = meta_model(config)
    total = sum(p.numel() for p in model.parameters())
    modules = {id(m.weight): m for _, m in quantised_modules(model)}          # a tied weight once
    weights = {key: m.weight for key, m in modules.items()}
    quantised = {key: w.numel() for key, w in weights.items()}
    units = {name: sum(p.numel() for p in m.parameters()) for name, m in sharding_units(model)}
    inner = getattr(model, "model", model)
    lang = getattr(inner, "language_model", inner)
    text = getattr(config, "text_config", config)
    cross = set(getattr(text, "cross_attention_layers", None) or [])
    layers = [sum(p.numel() for p in layer.parameters()) for layer in lang.layers]
    vision = getattr(inner, "vision_model", None)
    tied = model.lm_head.weight is lang.embed_tokens.weight
    out = {
        "total": total, "quantised": sum(quantised.values()), "quantised_matrices": len(quantised),
        "largest_matrix": max(quantised.values()), "largest_unit": max(units.values()),
        "largest_quantised_unit": max(quantised.values()),
        "embed": lang.embed_tokens.weight.numel(), "lm_head": 0 if tied else model.lm_head.weight.numel(),
        "projector": sum(p.numel() for p in inner.multi_modal_projector.parameters()) if vision is not None else 0,
        "text_self_layer": max((n for i, n in enumerate(layers) if i not in cross), default=0),
        "text_self_layers": len(layers) - len(cross),
        "text_cross_layer": max((n for i, n in enumerate(layers) if i in cross), default=0),
        "text_cross_layers": len(cross),
        "vision_local_layers": len(vision.transformer.layers) if vision is not None else 0,
        "vision_global_layers": len(vision.global_transformer.layers) if vision is not None else 0,
        "layer_matrices": _layer_matrices(lang.layers[0]),
        "quantised_shapes": [tuple(w.shape) for w in weights.values()],
        # calibrate's X^T X: one d_in x d_in matrix per quantised Linear (embeddings have none)
        "calibration_elements": sum(m.in_features ** 2 for m in modules.values() if hasattr(m, "in_features")),
    }
    return out


def _layer_matrices(layer) -> list[tuple[int, int]]:
    """``(d_out, d_in)`` of each Linear of a decoder layer (the direct cast works one layer at a time)."""
    from torch import nn
    return [tuple(m.weight.shape) for m in layer.modules() if isinstance(m, nn.Linear)]


# --- the terms ----------------------------------------------------------------------------------------------------

@dataclass
class Workload:
    """What one QAT micro-step processes on one device."""
    micro_batch: int                 # sequences per device per micro-step
    seq: int                         # text tokens per sequence
    tiles: int = 0                   # vision tiles per image the encoder runs (Mllama pads to max_num_tiles)


def _shape(config) -> dict:
    t = getattr(config, "text_config", config)
    v = getattr(config, "vision_config", None)
    patches = (v.image_size // v.patch_size) ** 2 + 1 if v is not None else 0
    return {"h": t.hidden_size, "i": t.intermediate_size,
            "kv": getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
            "kv_heads": t.num_key_value_heads, "V": t.vocab_size,
            "d": v.hidden_size if v else 0, "m": v.intermediate_size if v else 0, "patches": patches,
            "padded": patches + (8 - patches % 8) % 8, "n_int": len(v.intermediate_layers_indices) if v else 0,
            "vision_heads": v.attention_heads if v else 0}


def activation_bytes(config, counts: dict, w: Workload, compute_bytes: int, checkpointing: bool) -> dict:
    """Activation memory of one student forward kept for its backward, per device, in bytes (estimates).

    Saved elements per token and layer, without checkpointing (every Linear input is fake-quantised to INT8
    first, and each quantised copy is saved: q/k/v and gate/up each keep their own):
      text self layer  12h + 4kv + 5i       (norms, 3 quantised inputs, q/k/v, attention out, MLP)
      text cross layer 12h + 2kv + 5i over text tokens, plus 2h + 3kv per image token (k/v projections)
      vision layer     12d + 5m over the encoder's padded tokens (tiles x padded patches)
    With checkpointing (per-layer checkpointing of the text decoder and both vision encoders) only each layer's
    input is kept (h or d per token) plus one layer's full set during its recompute, the vision outputs kept for
    the projector and the projected image tokens. Logits: the teacher's and student's (compute dtype), both
    log-softmaxes and the logits' gradient in fp32."""
    sh = _shape(config)
    h, i, d, m, V = sh["h"], sh["i"], sh["d"], sh["m"], sh["V"]
    kv = sh["kv"] * sh["kv_heads"]
    text_tokens = w.micro_batch * w.seq
    img_tokens = w.micro_batch * w.tiles * sh["patches"]
    vis_tokens = w.micro_batch * w.tiles * sh["padded"]
    n_self, n_cross = counts["text_self_layers"], counts["text_cross_layers"]
    n_vis = counts["vision_local_layers"] + counts["vision_global_layers"]
    self_full = text_tokens * (12 * h + 4 * kv + 5 * i)
    cross_full = text_tokens * (12 * h + 2 * kv + 5 * i) + img_tokens * (2 * h + 3 * kv)
    vis_full = vis_tokens * (12 * d + 5 * m)
    vision_keep = vis_tokens * d * (sh["n_int"] + 1) + img_tokens * h
    if checkpointing:
        elements = ((n_self + n_cross) * text_tokens * h + n_vis * vis_tokens * d
                    + max(self_full, cross_full if n_cross else 0, vis_full if n_vis else 0) + vision_keep)
    else:
        elements = n_self * self_full + n_cross * cross_full + n_vis * vis_full + vision_keep
    logits = text_tokens * V * (2 * compute_bytes + 3 * 4)
    return {"layers": elements * compute_bytes, "logits": logits}


def qat_device(config, counts: dict, *, devices: int, workload: Workload, compute_bytes: int, strategy: str,
               teacher: str, checkpointing: bool, teacher_bytes: int, kl_cache_bytes: float = 0) -> dict:
    """Per-device bytes of a QAT step by term. FSDP2: masters, gradients (reduce-scattered every micro-batch) and
    AdamW moments sharded ``devices`` ways, the fake-quantised modules gathered in fp32 (two units: the current
    and the prefetched), each unit's unsharded fp32 gradient before its reduce-scatter; DDP: all of it whole."""
    P = counts["total"]
    shards = devices if strategy == "fsdp2" else 1
    unit = counts["largest_unit"]
    parts = {"teacher": teacher_bytes * P / devices + 2 * teacher_bytes * unit
             if teacher == "shard" and strategy == "fsdp2" else teacher_bytes * P,
             "masters_fp32": 4 * P / shards, "grads_fp32": 4 * P / shards + (4 * unit if shards > 1 else 0),
             "adamw": 8 * P / shards, "gathered_units": 2 * 4 * unit if shards > 1 else 0}
    linear_q = counts["quantised"] - counts["embed"]
    # with checkpointing the unit being recomputed holds its fake-quantised weights for its own backward
    saved = counts["lm_head"] + counts["projector"] + unit if checkpointing else linear_q
    parts["saved_quantised_weights"] = compute_bytes * saved
    act = activation_bytes(config, counts, workload, compute_bytes, checkpointing)
    parts["activations"], parts["logits"] = act["layers"], act["logits"]
    if kl_cache_bytes:
        parts["kl_cache"] = kl_cache_bytes
    return parts


def step_host(counts: dict, file_bytes: float | None = None) -> dict:
    """Host bytes above the interpreter of the single-process steps: fit and pack stream one matrix at a time
    (the largest one sets the peak), loading holds the weights once."""
    P, Q, big = counts["total"], counts["quantised"], counts["largest_matrix"]
    other = P - Q
    packed = file_bytes if file_bytes is not None else Q / 3 + 2 * other
    # a tensor read maps its bf16 pages (2 bytes a weight) for as long as it lives (pipeline.packed.checkpoint)
    return {"fit": big * 3 * 4,                  # the fp32 matrix (its pages go with the bf16 tensor), its squared
            #                                      error, the error's rows without the all-zero ones (a padding row)
            "pack": big * (2 + 4 + 1 / 3),       # its pages, the fp32 copy the encoder reads, the packed bytes
            "load_lazy": packed + 2 * other,     # packed bytes + the bf16 rest upcast to fp32
            "load_eager": 4 * P + big * (1 + 1 / 3)}   # every weight decoded to fp32; the largest one's INT8
    #                                                    decode and its packed pages on top


# --- the plan -------------------------------------------------------------------------------------------------------

@dataclass
class Phase:
    """One phase of one stage: bytes by term on each device and on each node's host (beyond the interpreter), and
    on disk: ``disk`` what it leaves there (outputs, their DVC cache copy), ``scratch`` what it holds only while it
    runs (checkpoints)."""
    stage: str
    phase: str
    device: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)      # the whole node: every process on it together
    disk: dict = field(default_factory=dict)
    scratch: dict = field(default_factory=dict)

    def total(self, where: str) -> float:
        return sum(getattr(self, where).values())


def teacher_config(params: dict, source: str | None = None):
    """``(config, its config.json)`` of the teacher a plan is for, from local files only: ``source`` (a model
    directory, its ``config.json``, or a hub id whose ``config.json`` is in the Hugging Face cache); else
    teacher-import's output ``teacher.dir`` if it was imported from ``teacher.source`` (``teacher_import.json``:
    a preset applied since names another teacher); else ``teacher.source``, read as ``source`` is."""
    from pipeline.models import load_config

    teacher = params["teacher"]
    why = ""
    if source is None:
        imported = Path(teacher.dir) / "teacher_import.json"
        held = json.loads(imported.read_text()).get("source") if imported.is_file() else teacher.source
        if (Path(teacher.dir) / "config.json").is_file() and _same_source(held, teacher.source):
            source = teacher.dir
        else:
            source = teacher.source
            if (Path(teacher.dir) / "config.json").is_file():
                why = f" (teacher.dir {teacher.dir} holds {held}, not teacher.source)"
    path = _local_config(str(source), why)
    return load_config(str(path.parent)), path


def _same_source(a: str, b: str) -> bool:
    return a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())


def _local_config(source: str, why: str = "") -> Path:
    """The ``config.json`` of ``source`` on this machine, never downloaded."""
    path = Path(source)
    if path.name == "config.json" and path.is_file():
        return path
    if (path / "config.json").is_file():
        return path / "config.json"
    hub = (source.count("/") == 1 and not path.exists() and not source.startswith((".", "/"))
           and not path.parent.is_dir())     # as pipeline.teacher.source.local_dir tells a hub id from a path
    if hub:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "config.json")
        if isinstance(cached, str):
            return Path(cached)
    fetch = (f"hf download {source} config.json" if hub else
             "dvc repro teacher-import" if source.startswith("gguf:") or source.endswith(".gguf") else
             f"hf download REPO config.json --local-dir {source}")
    raise FileNotFoundError(f"{source}: no config.json here or in the Hugging Face cache{why}; the plan reads the "
                            f"teacher's config from local files: `{fetch}`, or pass --config DIR")


def plan(params: dict, config=None, counts: dict | None = None, cache_copies: bool = True) -> list[Phase]:
    """Every stage's phases for ``params`` (``pipeline.params.read``) on the teacher ``config``, in the order
    ``dvc repro`` runs them; ``cache_copies``: DVC copies each cached output into its cache (``dvc_cache``)."""
    launch, qat, gen, cal = params["launch"], params["qat"], params["generate"], params["calibrate"]
    config = config or teacher_config(params)[0]
    counts = counts or count_params(config)
    sh = _shape(config)
    P = counts["total"]
    tb = 2 if params["teacher"].dtype == "bfloat16" else 4
    cb = 2 if launch.compute_dtype == "bfloat16" and launch.strategy == "fsdp2" else 4
    D = launch.num_processes
    per_node = D // launch.machines()
    tiles = getattr(getattr(config, "vision_config", None), "max_num_tiles", 0) or 0
    n_layers = counts["text_self_layers"] + counts["text_cross_layers"]
    kv_width = 2 * sh["kv"] * sh["kv_heads"]             # a token's keys and values in one layer
    disk = disk_terms(params, counts)
    phases = []

    def stage_disk(ph: Phase, stage: str) -> Phase:
        """``ph`` with the disk terms of ``stage``: its cached outputs (and their cache copy), its other files."""
        cached, other = disk.get(stage, ({}, {}))
        ph.disk.update({**cached, **other})
        if cache_copies and cached:
            ph.disk["dvc_cache_copy"] = sum(cached.values())
        return ph

    phases.append(stage_disk(Phase("teacher-import", "write"), "teacher-import"))
    host = step_host(counts)
    phases.append(Phase("fit-centroids", "largest matrix", host={"fit": host["fit"]}))   # fit.threads: torch's

    seq = qat.max_seq_len + gen.max_new_tokens
    phases.append(stage_disk(Phase("teacher-generate", "generate", device={
        "teacher": tb * P, "kv_cache": gen.batch_size * seq * counts["text_self_layers"] * kv_width * tb,
        "image_states": gen.batch_size * tiles * sh["patches"] * counts["text_cross_layers"] * kv_width * tb,
        "logits": gen.batch_size * sh["V"] * 4}, host={"teacher_load": per_node * tb * P}), "teacher-generate"))

    hess = sum(k * k * 8 for _, k in counts["layer_matrices"]) * n_layers
    phases.append(stage_disk(Phase("calibrate", "forward", device={"teacher": tb * P, "hessian_sums_fp64": min(
        hess, cal.hessian_memory_gb * GB)}, host={"teacher_load": tb * P}), "calibrate"))

    layer = counts["layer_matrices"]
    phases.append(stage_disk(Phase("direct-cast", "largest layer", host={
        "layer_fp32_and_start": per_node * sum(12 * n * k for n, k in layer),
        "hessians_fp64": per_node * max(2 * 8 * k * k for _, k in layer)}), "direct-cast"))

    examples = max(params["sample"].n_prompts - params["heldout_prompts"], 0)
    kl = examples * gen.max_new_tokens * sh["V"] * tb if qat.teacher_logits == "cache" else 0
    micro = max(qat.batch_size // (qat.grad_accum * D), 1)
    device = qat_device(config, counts, devices=D, workload=Workload(micro, qat.max_seq_len, tiles), compute_bytes=cb,
                        strategy=launch.strategy, teacher=launch.teacher,
                        checkpointing=launch.gradient_checkpointing, teacher_bytes=tb, kl_cache_bytes=kl)
    # FSDP2: rank 0 alone reads the student (and a sharded teacher) and sends the others their shards, one after
    # the other (the teacher's whole copy is gone before the student's is read); DDP: every rank reads both
    fsdp = launch.strategy == "fsdp2"
    rank0_teacher = tb * P if launch.teacher == "shard" and fsdp else per_node * tb * P
    phases.append(Phase("qat-train", "load teacher", host={"teacher_load": rank0_teacher}))
    phases.append(Phase("qat-train", "load student", host={"student_fp32_rank0" if fsdp else "student_fp32": (
        1 if fsdp else per_node) * 4 * P}))
    # a checkpoint every qat.checkpoint_every steps before the last; the previous one is deleted once the next is
    # complete, so two lie on disk while one is written; the last one is still there when the student is saved
    checkpoints = min(2, (qat.steps - 1) // qat.checkpoint_every)
    phases.append(Phase("qat-train", "train", device=device, scratch={
        f"checkpoints_x{checkpoints}": checkpoints * disk["checkpoint"]} if checkpoints else {}))
    # rank 0 gathers the fp32 student on the host and save_pretrained's safetensors serialiser copies it to bytes
    phases.append(stage_disk(Phase("qat-train", "save", host={"student_fp32_rank0": 4 * P, "serialised_copy": 4 * P},
                                   scratch={"last_checkpoint": disk["checkpoint"]} if checkpoints else {}),
                             "qat-train"))

    phases.append(stage_disk(Phase("pack-safetensors", "largest matrix", host={"pack": host["pack"]}),
                             "pack-safetensors"))
    if "export-sqt" in disk:
        phases.append(stage_disk(Phase("export-sqt", "write"), "export-sqt"))
    # every rank holds the bf16 teacher for the KL beside the packed model it scores
    phases.append(Phase("eval", "lazy load", host={"teacher_load": per_node * tb * P,
                                                   "packed_model": per_node * host["load_lazy"]}))
    return phases


def disk_terms(params: dict, counts: dict) -> dict:
    """Bytes each stage writes, from the parameter counts and the formats' ``storage_bytes``:
    ``{stage: (cached outputs, other files)}`` and ``checkpoint``, one QAT checkpoint. Outputs of a stage of
    every format (direct-cast, qat-train, pack-safetensors) are summed over ``params["formats"]``."""
    from pipeline import formats

    P, Q, shapes = counts["total"], counts["quantised"], counts["quantised_shapes"]
    names = params["formats"]
    packed = {f: sum(formats.get(f).storage_bytes(s) for s in shapes) for f in names}
    rest = (2 if params["pack"].dtype in ("bfloat16", "float16") else 4) * (P - Q)
    gen = params["generate"]
    answers = params["sample"].n_prompts * (params["qat"].max_seq_len + gen.max_new_tokens) * 8
    terms = {
        "teacher-import": ({"teacher_bf16": 2 * P}, {}),
        # token ids (int64) of prompts and answers at their longest; Parquet compresses them below this
        "teacher-generate": ({"answers": answers}, {"answer_shards_checkpoints": answers}),
        "calibrate": ({"hessians_fp32": 4 * counts["calibration_elements"]}, {}),
        # per weight its packed tensors and the float32 start of QAT
        "direct-cast": ({"casts": sum(packed.values()) + 4 * Q * len(names)}, {}),
        "qat-train": ({"students_fp32": 4 * P * len(names)}, {}),
        # the direct cast and the QAT student, each a packed model
        "pack-safetensors": ({"packed_models": 2 * (sum(packed.values()) + rest * len(names))}, {}),
        # fp32 masters and AdamW's two moments (the learned scales and the step counts are small beside them)
        "checkpoint": 12 * P,
    }
    if formats.SUBJECT in names:       # export-sqt writes the subject's packed models as .sqt files
        terms["export-sqt"] = ({"sqt_files": 2 * (packed[formats.SUBJECT] + 2 * (P - Q))}, {})
    return terms


def memory_available(gpu_gb: float | None = None, host_gb: float | None = None) -> tuple[float | None, float]:
    """``(bytes of one GPU or None without one, host bytes of this node)``: given, or this machine's."""
    gpu = gpu_gb * GB if gpu_gb else None
    if gpu is None:
        import torch
        if torch.cuda.is_available():
            gpu = float(torch.cuda.get_device_properties(0).total_memory)
    if host_gb:
        return gpu, host_gb * GB
    return gpu, float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def dvc_cache(root: str | Path = ".") -> tuple[Path, bool]:
    """``(directory, copies)``: DVC's cache directory (``cache.dir`` of ``.dvc/config`` or ``config.local``, relative
    to ``.dvc/``; by default ``.dvc/cache``) and whether it may hold a copy of each output (``cache.type`` with
    ``copy``, as DVC's default ``reflink,copy`` falls back to on a file system without reflinks)."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read([Path(root) / ".dvc" / "config", Path(root) / ".dvc" / "config.local"])
    cache = cfg["cache"] if cfg.has_section("cache") else {}
    return Path(root) / ".dvc" / Path(cache.get("dir", "cache")).expanduser(), "copy" in cache.get("type", "copy")


def disk_available(root: str | Path = ".", cache_dir: str | Path | None = None) -> dict[str, tuple[Path, float]]:
    """Free bytes where a run writes: ``{"project": (root, bytes)}`` (outputs and checkpoints), and ``"dvc_cache"``
    when DVC's cache lies on another file system (else its copies come out of the project's)."""
    places = {"project": Path(root).resolve()}
    if cache_dir is not None:
        cache = Path(cache_dir).absolute()
        while not cache.exists():                      # a cache not made yet goes where its first parent lies
            cache = cache.parent
        if cache.stat().st_dev != Path(root).stat().st_dev:
            places["dvc_cache"] = cache
    return {place: (path, float(shutil.disk_usage(path).free)) for place, path in places.items()}


def disk_needs(phases: list[Phase], free: dict[str, tuple[Path, float]]):
    """``(phase, place, left, own)`` for each phase and place of ``free`` (:func:`disk_available`): the bytes the
    phases before it left there, and its own terms there (outputs, their DVC cache copy, scratch)."""
    def place(term: str) -> str:
        return "dvc_cache" if term == "dvc_cache_copy" and "dvc_cache" in free else "project"

    left = dict.fromkeys(free, 0.0)
    for ph in phases:
        for where in free:
            yield ph, where, left[where], {k: v for k, v in {**ph.disk, **ph.scratch}.items() if place(k) == where}
        for k, v in ph.disk.items():
            left[place(k)] += v


def check_disk(phases: list[Phase], free: dict[str, tuple[Path, float]]) -> list[str]:
    """A line for the first phase at which each place of ``free`` runs out of disk, naming the bytes before it and
    its own. Give the phases of one stage to check that stage alone (what earlier stages left is on disk already)."""
    problems, full = [], set()
    for ph, where, left, own in disk_needs(phases, free):
        path, limit = free[where]
        need = left + sum(own.values())
        if own and need > limit and where not in full:
            full.add(where)
            problems.append(f"{ph.stage} ({ph.phase}): {_size(need)} of disk at {path} > {_size(limit)} free; left "
                            f"by the stages before it {_size(left)}, its own "
                            + ", ".join(f"{k} {_size(v)}" for k, v in own.items()))
    return problems


def _size(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.2f} MB"


def check(phases: list[Phase], gpu_bytes: float | None, host_bytes: float, processes_per_node: int,
          stage: str | None = None) -> list[str]:
    """Lines naming each phase (of ``stage``, or all) that does not fit, with its largest terms. Without a GPU the
    device terms of every process on the node come out of its host memory."""
    problems = []
    for ph in phases:
        if stage and ph.stage != stage:
            continue
        if gpu_bytes is not None and ph.total("device") > gpu_bytes:
            problems.append(_over(ph, "device", ph.device, gpu_bytes, "per GPU"))
        host = dict(ph.host)
        if gpu_bytes is None:
            host.update({f"{k} (x{processes_per_node} processes)": v * processes_per_node for k, v in ph.device.items()})
        if sum(host.values()) > host_bytes:
            problems.append(_over(ph, "host", host, host_bytes, "host RAM per node"))
    return problems


def _over(ph: Phase, where: str, terms: dict, limit: float, what: str) -> str:
    top = sorted(terms.items(), key=lambda kv: -kv[1])[:3]
    return (f"{ph.stage} ({ph.phase}): {sum(terms.values()) / GB:.1f} GB {what} > {limit / GB:.1f} GB available; "
            f"largest terms: " + ", ".join(f"{k} {v / GB:.1f} GB" for k, v in top))


def table(phases: list[Phase]) -> list[tuple[str, str, str, str, float]]:
    """``(stage, phase, where, term, GB)`` rows, each phase's terms then its total."""
    rows = []
    for ph in phases:
        for where in ("device", "host", "disk", "scratch"):
            terms = getattr(ph, where)
            for k, v in terms.items():
                rows.append((ph.stage, ph.phase, where, k, v / GB))
            if len(terms) > 1:
                rows.append((ph.stage, ph.phase, where, "total", ph.total(where) / GB))
    return rows


def stage_of(script: str) -> str | None:
    """The plan's stage name of a stage script (``stages/qat_train.py`` -> ``qat-train``), if it has one."""
    return Path(script).stem.replace("_", "-")


def summary(phases: list[Phase], gpu: float | None, host: float,
            disk: dict[str, tuple[Path, float]] | None = None) -> str:
    fmt = "{:<18} {:<15} {:<7} {:<36} {:>9}"
    lines = [fmt.format("stage", "phase", "where", "term", "GB")]
    lines += [fmt.format(s, p, w, t, f"{gb:.2f}") for s, p, w, t, gb in table(phases)]
    lines.append(f"available: {'no GPU' if gpu is None else f'{gpu / GB:.1f} GB per GPU'}, "
                 f"{host / GB:.1f} GB host RAM per node")
    for where, (path, free) in (disk or {}).items():
        peak = max((left + sum(own.values()) for _, w, left, own in disk_needs(phases, disk) if w == where), default=0)
        lines.append(f"disk at {path} ({where}): the run holds at most {_size(peak)} at once, {_size(free)} free")
    return "\n".join(lines)
