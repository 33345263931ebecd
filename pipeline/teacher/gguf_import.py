"""A Llama GGUF file as a plain bf16 Hugging Face directory.

transformers reads a Llama GGUF (``from_pretrained(dir, gguf_file=...)``) but keeps no way to save it. This
module writes the same model as a directory every stage reads: the config and the tokenizer (with its chat
template) are the ones transformers builds from the file; the weights are dequantised with ``gguf``'s numpy
``dequantize`` and named and un-permuted exactly as transformers' GGUF loader does for Llama
(``transformers/modeling_gguf_pytorch_utils.py``): GGUF names map to Hugging Face names through ``gguf``'s
own tensor-name map over the model's state dict, and the rows of ``attn_q`` / ``attn_k`` are put back from
llama.cpp's rotary (interleaved) order into Hugging Face's (halves) order. A GGUF without ``output.weight``
has tied embeddings (``lm_head`` is ``embed_tokens``), as transformers decides. Tensors are converted and
written one at a time, so memory holds one matrix (in float32) beside the reader's memory map.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from pipeline.packed.safetensors_io import StreamingWriter
from pipeline.teacher.source import SourceError




ARCHITECTURE = "llama"          # the GGUF ``general.architecture`` this import reads


def open_gguf(path: str | Path):
    """``gguf.GGUFReader`` of ``path``, its architecture checked (Llama only)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError, struct.error, ... for a file that is not GGUF
        raise SourceError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e)[:200]})") from None
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch != ARCHITECTURE:
        raise SourceError(f"{path}: GGUF architecture {arch!r} is not supported; the teacher import reads "
                           f"{ARCHITECTURE!r} (text-only Llama) files")
    return reader


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of a q/k projection: per head, rows in rotary pairs ``(0, d/2), (1, d/2+1)...``
    back to Hugging Face's halves; the inverse transformers' ``LlamaTensorProcessor`` applies."""
    dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, dim, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` (``convert_hf_to_gguf.py``): Hugging Face q/k rows to the GGUF order."""
    dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, dim, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def add_bf16_tensor_info(writer, name: str, shape: tuple[int, ...]) -> None:
    """Declare a Hugging Face tensor as a bf16 GGUF holds it (what :func:`bf16_gguf_array` writes): a vector
    (a norm) in float32, a matrix in BF16."""
    import math

    import gguf

    if len(shape) == 1:
        writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
    else:
        writer.add_tensor_info(name, shape, np.dtype(np.uint16), 2 * math.prod(shape),
                               raw_dtype=gguf.GGMLQuantizationType.BF16)


def bf16_gguf_array(t: torch.Tensor, rope_heads: int | None = None) -> np.ndarray:
    """The bytes of a Hugging Face tensor in a bf16 GGUF: a vector as float32, a matrix as bf16 (its rows in
    llama.cpp's rotary order, :func:`permute_rows`, for a q/k projection with ``rope_heads`` heads)."""
    if t.dim() == 1:
        return t.float().numpy()
    arr = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return permute_rows(arr, rope_heads) if rope_heads else arr


def load_config(path: Path):
    """The ``LlamaConfig`` transformers builds from the file (what its GGUF loader runs), in bf16."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if config.model_type != ARCHITECTURE:
        raise SourceError(f"{path}: transformers reads this GGUF as model_type {config.model_type!r}, not "
                           f"{ARCHITECTURE!r}")
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    return config


def name_map(config) -> dict[str, str]:
    """``{GGUF tensor name: Hugging Face state-dict name}`` for every tensor of ``LlamaForCausalLM(config)``,
    built the way transformers' ``get_gguf_hf_weights_map`` builds it (``gguf``'s name map)."""
    from gguf import MODEL_ARCH, get_tensor_name_map
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    mapping = {}
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is not None:
            mapping[f"{gguf_name}.{suffix}"] = hf_name
    return mapping


def convert_tensor(tensor, config) -> np.ndarray:
    """One GGUF tensor as float32 in Hugging Face layout."""
    from gguf import dequantize

    weight = dequantize(tensor.data, tensor.tensor_type)
    if ".attn_q." in tensor.name:
        weight = unpermute_rows(weight, config.num_attention_heads)
    elif ".attn_k." in tensor.name:
        weight = unpermute_rows(weight, config.num_key_value_heads)
    return np.array(weight, dtype=np.float32, order="C")     # a copy: the reader maps the file read-only


def write_weights(path: Path, reader, config, out: Path) -> dict:
    """``out`` (``model.safetensors``): every tensor the model needs, in bf16, one at a time. Returns what was
    read: GGUF tensor types and the tensors skipped (ones transformers' loader skips too, e.g. ``rope_freqs``)."""
    from transformers import LlamaForCausalLM

    mapping = name_map(config)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    tensors = {t.name: t for t in reader.tensors}
    chosen = {hf: tensors[g] for g, hf in mapping.items() if g in tensors}
    if config.tie_word_embeddings:          # lm_head is embed_tokens: saved once, like save_pretrained
        expected.pop("lm_head.weight", None)
        chosen.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(chosen))
    if missing:
        wanted = {hf: g for g, hf in mapping.items()}
        raise SourceError(f"{path}: the GGUF lacks tensors the Llama config needs, e.g. "
                           f"{[wanted.get(m, m) for m in missing[:3]]}")
    specs = []
    for hf_name in sorted(chosen):
        shape = tuple(int(d) for d in reversed(chosen[hf_name].shape.tolist()))
        if shape != expected[hf_name]:
            raise SourceError(f"{path}: tensor {chosen[hf_name].name!r} has shape {list(shape)}, the config "
                               f"({hf_name}) needs {list(expected[hf_name])}")
        specs.append((hf_name, torch.bfloat16, shape))
    with StreamingWriter(out, specs, {"format": "pt"}) as writer:
        for hf_name, _, _ in specs:
            weight = torch.from_numpy(convert_tensor(chosen[hf_name], config))
            if not bool(torch.isfinite(weight).all()):
                raise SourceError(f"{path}: tensor {chosen[hf_name].name!r} holds NaN or Inf")
            writer.write(hf_name, weight.to(torch.bfloat16))
    used = {t.name for t in chosen.values()}
    return {"gguf_tensor_types": dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items())),
            "skipped_tensors": sorted(set(tensors) - used)}


def write_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer transformers builds from the file (vocabulary, merges, special tokens, chat template)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # the builders raise ValueError/KeyError for a tokenizer they cannot read
        raise SourceError(f"{path}: transformers cannot build its tokenizer ({type(e).__name__}: "
                           f"{str(e)[:200]})") from None
    tokenizer.save_pretrained(str(out))


def convert(path: str | Path, out: Path, check_config=None) -> dict:
    """Write the Hugging Face files of the GGUF ``path`` into the (empty) directory ``out``; ``check_config``
    sees the config before any tensor is read. Returns the GGUF's facts for the provenance record."""
    from transformers import GenerationConfig

    path = Path(path)
    reader = open_gguf(path)
    config = load_config(path)
    if check_config is not None:
        check_config(config)
    facts = write_weights(path, reader, config, out / "model.safetensors")
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    write_tokenizer(path, out)
    return facts
