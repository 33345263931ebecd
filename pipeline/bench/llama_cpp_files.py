"""llama.cpp's side of the real-model benchmark, kept apart from the run so that each piece can be used and tested
alone: the teacher written as a bf16 GGUF, llama.cpp's quantizer, what a GGUF (or one of our packed files) holds
and its bits per weight, and a GGUF's logits through ``llama-cpp-python``.

Bits per weight (``bits_per_weight``) count the same thing in every file: the bytes of every 2-D weight tensor
(the matrices and the token embedding, with their block scales, tables and per-row scales; a tied output head
once, as the file holds it) x 8 / the number of weights in them; norms and file headers are not counted.
``file_bits_per_weight`` is the whole file's bytes x 8 over the same number of weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections import Counter
from pathlib import Path

import torch

from pipeline.bench import generate
from pipeline.files.atomic import atomic_path

# the types the issue names (each also with the token embedding at its type)
REQUIRED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "Q4_K_M", "Q3_K_S", "Q2_K")
# every file type of llama.cpp's quantizer that is a quantisation (llama-quantize's list, BF16/F16/F32 aside);
# those it refuses here (no importance matrix) are recorded as refusals
ALL_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "IQ4_NL",
             "IQ4_XS", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "Q2_K", "Q2_K_S", "IQ2_M",
             "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "TQ2_0", "TQ1_0", "Q2_0", "Q1_0", "NVFP4", "MXFP4_MOE")
# file types whose main tensor type has another name (llama.cpp's llama_model_quantize_impl)
_MAIN_TYPE = {"IQ3_M": "IQ3_S", "IQ3_XS": "IQ3_S", "IQ2_M": "IQ2_S", "MXFP4_MOE": "MXFP4"}


# --- the teacher as GGUF ---------------------------------------------------------------------------------------

def source_gguf(teacher_dir: str | Path) -> Path:
    """The GGUF a teacher directory was imported from (its ``teacher_import.json``): the installed package's file
    or the local path."""
    from pipeline.teacher.source import PROVENANCE, package_file

    record = Path(teacher_dir) / PROVENANCE
    if not record.is_file():
        raise FileNotFoundError(f"{record}: missing; the teacher directory must come from "
                                f"`python -m pipeline.teacher import` of a GGUF (or give --source-gguf)")
    info = json.loads(record.read_text())
    source = info.get("source", "")
    if info.get("kind") != "gguf" and not source.endswith(".gguf"):
        raise ValueError(f"{record}: the teacher was imported from {source!r}, not a GGUF; give --source-gguf")
    return package_file(source)[0] if source.startswith("gguf:") else Path(source)


def unrotated_teacher(teacher_dir: str | Path, work: str | Path) -> Path:
    """The teacher as llama.cpp's users have it, to write llama.cpp's files from: ``teacher_dir`` itself, or, where
    it was imported rotated (``teacher.rotate``: the same function, other matrices to quantise), the same source
    imported again without the rotation at ``work/teacher-unrotated`` (made when missing or older than
    ``teacher_dir``)."""
    from pipeline.teacher.importer import import_teacher
    from pipeline.teacher.source import PROVENANCE

    teacher_dir = Path(teacher_dir)
    record = teacher_dir / PROVENANCE
    info = json.loads(record.read_text()) if record.is_file() else {}
    if info.get("rotate", {"kind": "none"})["kind"] == "none":
        return teacher_dir
    out = Path(work) / "teacher-unrotated"
    made = out / PROVENANCE
    if (stale(made, teacher_dir / "model.safetensors")
            or json.loads(made.read_text()).get("source") != info["source"]):
        import_teacher(info["source"], out)
    return out


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
    the source holds it; a head of the teacher's own that the source lacks (a tied source) is added as
    ``output.weight``."""
    import gguf
    import numpy as np
    from safetensors import safe_open
    from transformers import AutoConfig

    from pipeline.teacher import gguf_import

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
        head = {hf for _, hf, _, _ in plan}
        if "lm_head.weight" in have and "lm_head.weight" not in head and not config.tie_word_embeddings:
            # a head of its own that the source does not hold (e.g. a rotated import of a tied model)
            name = next(g for g, h in mapping.items() if h == "lm_head.weight")
            plan.append((name, "lm_head.weight", tuple(f.get_slice("lm_head.weight").get_shape()), None))
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
            else:
                gguf_import.add_bf16_tensor_info(writer, name, shape)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, hf, shape, t in plan:
            if hf is None:
                writer.write_tensor_data(np.ascontiguousarray(t.data))
                continue
            heads = (config.num_attention_heads if ".attn_q." in name
                     else config.num_key_value_heads if ".attn_k." in name else None)
            arr = gguf_import.bf16_gguf_array(f.get_tensor(hf), heads)
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


def stale(path: Path, *sources: Path) -> bool:
    return not path.exists() or any(path.stat().st_mtime < s.stat().st_mtime for s in sources)


# --- what a file holds ------------------------------------------------------------------------------------------

def census(path: str | Path) -> dict:
    """What a GGUF file really holds: ``types`` (tensor type -> count, bytes, weights), ``roles`` (tensor role,
    e.g. ``attn_q`` or ``token_embd``, -> tensor type -> count), and its bits per weight (see the module doc)."""
    from importlib.metadata import version

    from gguf import GGUFReader

    size = Path(path).stat().st_size
    try:
        reader = GGUFReader(str(path))
    except ValueError as e:         # a tensor type newer than gguf-py: the file runs, its bytes cannot be counted
        return {"types": {}, "roles": {}, "weight_bytes": None, "weights": None, "file_bytes": size,
                "bits_per_weight": None, "bits_per_weight_linears": None, "file_bits_per_weight": None,
                "error": f"gguf-py {version('gguf')} cannot read {Path(path).name} ({e}): bits per weight not counted"}
    types: dict[str, dict] = {}
    roles: dict[str, Counter] = {}
    wbytes = weights = lbytes = lweights = 0
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
            if t.name.startswith("blk."):                  # a decoder layer's matrix
                lbytes += int(t.n_bytes)
                lweights += int(t.n_elements)
    return {"types": dict(sorted(types.items())),
            "roles": {r: dict(sorted(c.items())) for r, c in sorted(roles.items())},
            "weight_bytes": wbytes, "weights": weights, "file_bytes": size,
            "bits_per_weight": 8 * wbytes / weights if weights else None,
            "bits_per_weight_linears": 8 * lbytes / lweights if lweights else None,
            "file_bits_per_weight": 8 * size / weights if weights else None}


def file_type(path: Path) -> str:
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


def packed_census(path: str | Path) -> dict:
    """The same count for one of our packed safetensors files: the tensors of every weight in its ``shapes``
    metadata (``W``, ``W.packed``, ``W.scale``, ``W.table`` ...) against that weight's number of elements."""
    from pipeline.runtime.models import read_header

    header, meta, _ = read_header(path)
    shapes = json.loads(meta.get("shapes", "{}"))
    for name, e in header.items():        # plain (unpacked) 2-D weights count too, e.g. a bf16 file
        if name.endswith(".weight") and len(e["shape"]) == 2 and name not in shapes:
            shapes[name] = e["shape"]
    nbytes = {name: e["data_offsets"][1] - e["data_offsets"][0] for name, e in header.items()}

    def count(chosen: dict) -> tuple[int, int]:
        held = sum(b for name, b in nbytes.items() if any(name == w or name.startswith(w + ".") for w in chosen))
        return held, sum(math.prod(s) for s in chosen.values())

    wbytes, weights = count(shapes)
    lbytes, lweights = count({w: s for w, s in shapes.items() if re.search(r"\.layers\.\d+\.", w)})
    size = Path(path).stat().st_size
    return {"weight_bytes": wbytes, "weights": weights, "file_bytes": size,
            "bits_per_weight": 8 * wbytes / weights if weights else None,
            "bits_per_weight_linears": 8 * lbytes / lweights if lweights else None,
            "precision": json.loads(meta.get("formats", "{}")),
            "file_bits_per_weight": 8 * size / weights if weights else None,
            "bits_per_param_actual": float(meta["bits_per_param_actual"]) if "bits_per_param_actual" in meta else None}


# --- a GGUF in this process -------------------------------------------------------------------------------------

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
