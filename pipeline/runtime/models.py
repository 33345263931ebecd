"""The models :mod:`pipeline.runtime.generation` generates with, over a packed file's tensors on the native kernels: the lean
Llama decoder (:class:`LeanLlama`), Hugging Face's Llama and the packed S3D8 Mllama with the same native modules
(:func:`hf_llama`, :func:`hf_mllama`), the row-decoding embeddings, and the files they read."""

from __future__ import annotations

import copy
import ctypes
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import formats, native
from pipeline.formats.precision import KEEP, file_formats
from pipeline.packed import safetensors_io
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.runtime import decode_step


class RuntimeInputError(ValueError):
    """Bad input to the runtime (model file, prompt, threads): the CLI prints it as one line."""


# --- files -------------------------------------------------------------------------------------------------

def read_header(path: str | Path) -> tuple[dict, dict[str, str], int]:
    """``(tensor entries, metadata, data offset)`` of a safetensors file; RuntimeInputError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise RuntimeInputError(f"{path}: no such file")
    try:
        return safetensors_io.read_header(path)
    except (OSError, ValueError) as e:
        raise RuntimeInputError(f"{e} (a packed model is a safetensors file)" if "truncated" not in str(e)
                                else str(e)) from None


def read_tensors(path: str | Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``(metadata, every tensor)`` of a packed file, read into private memory by the packed files' one reader
    (:class:`~pipeline.packed.checkpoint.CheckpointReader`, ``private=True``); RuntimeInputError if the file is not
    one."""
    read_header(path)
    try:
        reader = CheckpointReader(path, private=True)
        return reader.metadata(), {name: reader.get(name) for name in reader.keys()}
    except (OSError, ValueError) as e:
        raise RuntimeInputError(str(e)) from None


def model_kind(path: str | Path) -> tuple[str, str]:
    """``("mllama" | "llama", format)`` of a packed file this runtime runs; RuntimeInputError otherwise."""
    _, meta, _ = read_header(path)
    fmt = meta.get("format")
    try:
        cfg = json.loads(meta.get("config", "null"))
    except ValueError:
        cfg = None
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    known = {f.name: f for f in (formats.get(n) for n in formats.names())}.get(fmt)
    native = known is not None and known.native_kernel             # its bytes on the native kernels
    if model_type == "llama" and native:
        return "llama", fmt
    if model_type == "mllama" and native and known.layout is not None:      # load_packed_model's files
        return "mllama", fmt
    raise RuntimeInputError(
        f"{path}: not a packed S3D8 model this runtime runs (metadata format={str(fmt)[:40]!r}, "
        f"model_type={str(model_type)[:40]!r}); it runs packed S3D8 Mllama files and the synthetic Llama "
        f"files (s3d8/int8/bf16); other packed formats run on torch: "
        f"pipeline.packed.file.load_packed_model(path, kernel='torch')")


# --- native layers -------------------------------------------------------------------------------------------

def _llama_modules(path, meta: dict, tensors: dict[str, torch.Tensor]):
    """``(config dict, format, linear(name) -> module, embedding module)`` of a packed Llama file: each weight on its
    format's native module and row embedding (the precision plan's formats: metadata ``formats``; a weight stored
    as it is, under its own name: bf16)."""
    cfg, main = json.loads(meta["config"]), formats.get(meta.get("format"))
    shapes = {k: tuple(v) for k, v in json.loads(meta["shapes"]).items()}
    others, keep = file_formats(path, meta, main), formats.get(KEEP)

    def parts(name: str):
        fmt = keep if name in tensors else others.get(name, main)
        return fmt, fmt.stored(tensors, name), shapes.get(name) or tuple(tensors[name].shape)

    def linear(name: str) -> nn.Module:
        fmt, t, shape = parts(name)
        return fmt.native_linear(t, shape, None)

    fmt, t, shape = parts("model.embed_tokens.weight")
    return cfg, main.name, linear, fmt.row_embedding(t, shape)


def _head(tensors: dict[str, torch.Tensor]) -> str:
    """The output head's weight name: ``lm_head.weight`` where the file holds one (in any format), else the tied
    embedding's."""
    untied = any(k == "lm_head.weight" or k.startswith("lm_head.weight.") for k in tensors)
    return "lm_head.weight" if untied else "model.embed_tokens.weight"


def _rotary(cfg: dict):
    """``(inv_freq, attention_scaling)`` exactly as Hugging Face's Llama computes them (``default`` and ``llama3``
    RoPE; tested bit for bit), without importing its modelling code (~115 MB of resident memory)."""
    rope = dict(cfg.get("rope_parameters") or {})
    if not rope:              # the older layout: rope_theta at the top, rope_scaling beside it
        rope = {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind != "llama3":
        raise RuntimeInputError(f"config: RoPE type {kind!r} is not supported by the lean runtime (default, llama3)")
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


# --- the lean Llama decoder ------------------------------------------------------------------------------------

class LeanLlama:
    """A Llama decoder over packed tensors: native Linear kernels (S3D8, INT8 or bf16 by file), row
    embeddings, a preallocated float32 KV cache, logits of the last position only, a decode token in one C call
    (``self.native``). Batch 1."""

    kind = "llama"

    def __init__(self, path: str | Path, max_len: int | None = None) -> None:
        meta, tensors = read_tensors(path)
        cfg, self.format, linear, self.embed = _llama_modules(path, meta, tensors)
        self.config = cfg
        self.n_layers, self.nh, self.nkv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.context = cfg["max_position_embeddings"]
        self.layers = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}"
            self.layers.append({
                "ln1": tensors[f"{p}.input_layernorm.weight"].float(),
                "ln2": tensors[f"{p}.post_attention_layernorm.weight"].float(),
                **{k: linear(f"{p}.{m}.weight") for k, m in
                   (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                    ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                    ("down", "mlp.down_proj"))}})
        self.norm = tensors["model.norm.weight"].float()
        self.lm_head = linear(_head(tensors))
        self.inv_freq, self.rope_scaling = _rotary(cfg)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.eos = set(cfg["eos_token_id"] if isinstance(cfg.get("eos_token_id"), list) else [cfg.get("eos_token_id")])
        self.allocate(max_len or 256)

    def allocate(self, max_len: int) -> None:
        """(Re)allocate the KV cache, the RoPE tables and the C decoder for ``max_len`` positions."""
        self.max_len = max_len
        self.k_cache = torch.zeros(self.n_layers, 1, self.nkv, max_len, self.hd)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.cos, self.sin_rolled = decode_step.rope_tables(self.inv_freq, self.rope_scaling, max_len)
        self.native = self.native_step()

    def session(self, max_len: int) -> "LeanLlama":
        """Another sequence over the same weights: a shallow copy with its own KV cache of ``max_len`` positions
        and its own C decoder (what ``s3d8 serve`` gives each request)."""
        other = copy.copy(self)
        other.allocate(max_len)
        return other

    def native_step(self, stub_products: bool = False) -> decode_step.DecodeStep:
        """The C decoder over this model's weights and caches (``stub_products``: see :mod:`pipeline.runtime.decode_step`)."""
        layers = [{**{k: L[k] for k in ("ln1", "ln2", "q", "k", "v", "o", "gate", "up", "down")},
                   "k_cache": self.k_cache[i, 0], "v_cache": self.v_cache[i, 0]} for i, L in enumerate(self.layers)]
        return decode_step.DecodeStep(hidden=self.config["hidden_size"], n_heads=self.nh, n_kv_heads=self.nkv,
                                      head_dim=self.hd, eps=self.eps, layers=layers, embed=self.embed,
                                      lm_head=self.lm_head, norm=self.norm, cos=self.cos, sin_rolled=self.sin_rolled,
                                      stub_products=stub_products)

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * 4

    def _rms(self, x, w):
        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(var + self.eps))

    def _rope(self, x, cos, sin_rolled):      # x [..., hd]
        """HF's ``x * cos + rotate_half(x) * sin`` as ``x * cos + roll(x, hd / 2) * sin_rolled``, ``sin`` with its
        first half negated: exact (the negation moves from x to sin), one roll instead of slices, a negation and a
        cat."""
        return x * cos + x.roll(self.hd // 2, -1) * sin_rolled

    def _attend_one(self, q: torch.Tensor, i: int, end: int) -> torch.Tensor:
        """Attention of a single decode token (``q`` [kv heads, q heads per kv head, hd]) over layer ``i``'s cache
        up to ``end``: two small batched products, cheaper than SDPA's kernel for one query row."""
        kc, vc = self.k_cache[i, 0].narrow(1, 0, end), self.v_cache[i, 0].narrow(1, 0, end)
        s = torch.bmm(q, kc.transpose(1, 2)) * self.hd ** -0.5
        return torch.bmm(torch.softmax(s, -1), vc).view(1, self.nh * self.hd)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: int, *, step: bool = True) -> torch.Tensor:
        """Logits (float32 ``[vocab]``) of the last of ``ids`` (1-D), placed at positions ``pos ...``. A single
        token takes the C step (``step=False``: the torch path, the same tokens, tested); its logits are a buffer
        the next step overwrites."""
        t = ids.numel()
        if pos + t > self.max_len:
            raise RuntimeInputError(f"{pos + t} positions exceed the KV cache of {self.max_len}")
        if t == 1 and step:
            return self._step(ids.reshape(1), pos)
        x = self.embed(ids.reshape(-1)).float()                         # [T, h]
        cos, sin = self.cos[pos:pos + t], self.sin_rolled[pos:pos + t]
        end = pos + t
        mask = None
        if t > 1 and pos > 0:
            mask = torch.ones(t, end, dtype=torch.bool).tril(diagonal=pos)
        for i, L in enumerate(self.layers):
            h = self._rms(x, L["ln1"])
            q = L["q"](h).view(t, self.nh, self.hd).transpose(0, 1)[None]
            k = L["k"](h).view(t, self.nkv, self.hd).transpose(0, 1)[None]
            v = L["v"](h).view(t, self.nkv, self.hd).transpose(0, 1)[None]
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.k_cache[i, :, :, pos:end] = k
            self.v_cache[i, :, :, pos:end] = v
            if t == 1:
                a = self._attend_one(q.view(self.nkv, self.nh // self.nkv, self.hd), i, end)
            else:
                a = F.scaled_dot_product_attention(q, self.k_cache[i, :, :, :end], self.v_cache[i, :, :, :end],
                                                   attn_mask=mask, is_causal=pos == 0, enable_gqa=True)
                a = a[0].transpose(0, 1).reshape(t, self.nh * self.hd)
            x = x + L["o"](a)
            h = self._rms(x, L["ln2"])
            x = x + L["down"](F.silu(L["gate"](h)) * L["up"](h))
        return self.lm_head(self._rms(x[-1:], self.norm))[0]

    def _step(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """One decode token in one C call (:mod:`pipeline.runtime.decode_step`) over the same weights and caches."""
        return self.native.step(int(ids), pos)

def hf_llama(path: str | Path):
    """Hugging Face ``LlamaForCausalLM`` over a synthetic packed file, the same native modules swapped in."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    meta, tensors = read_tensors(path)
    cfg, fmt, linear, embed = _llama_modules(path, meta, tensors)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.model.embed_tokens = embed
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, m, linear(f"{p}.self_attn.{m}.weight"))
        for m in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer.mlp, m, linear(f"{p}.mlp.{m}.weight"))
        layer.input_layernorm.weight = nn.Parameter(tensors[f"{p}.input_layernorm.weight"].float(), requires_grad=False)
        layer.post_attention_layernorm.weight = nn.Parameter(tensors[f"{p}.post_attention_layernorm.weight"].float(),
                                                             requires_grad=False)
    model.model.norm.weight = nn.Parameter(tensors["model.norm.weight"].float(), requires_grad=False)
    model.lm_head = linear(_head(tensors))
    model.model.rotary_emb = LlamaRotaryEmbedding(config)
    model.config.tie_word_embeddings = False      # the head is its own module over the same packed bytes
    model.weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    model.eval()
    return model


def hf_mllama(path: str | Path):
    """The packed S3D8 Mllama on the native kernels: its weights read into private memory, its embeddings mapped
    from the file and decoding only the rows they look up (``load_packed_model(..., private=True)``), its vision
    encoder keeping only what is read (:class:`VisionEncoder`)."""
    from pipeline.packed.file import load_packed_model

    _return_large_frees()
    model = load_packed_model(path, kernel="native", decode="lazy", private=True)
    _share_image_kv_heads(model.model.language_model)
    vision = model.model.vision_model
    vision.transformer = VisionEncoder(vision.transformer.layers, keep=vision.intermediate_layers_indices)
    vision.global_transformer = VisionEncoder(vision.global_transformer.layers, keep=())
    for module in [*vision.modules(), model.model.multi_modal_projector]:     # the image's 6,432 tokens
        if isinstance(module, (nn.Linear, native.S3D8Linear, native.Int8Linear)):
            in_row_blocks(module, ROW_BLOCK)
    model.weight_bytes = Path(path).stat().st_size
    return model


class VisionEncoder(nn.Module):
    """Mllama's vision encoder (the same layers, the same numbers) keeping only the hidden states its model reads:
    transformers' keeps every layer's output (``hidden_states``), 40 of 6,432 x 1,280 floats for the 11B's four
    tiles, where the vision model reads five; the others are None. Each layer's MLP runs on blocks of
    :data:`ROW_BLOCK` tokens (:func:`in_row_blocks`)."""

    def __init__(self, layers: nn.ModuleList, keep) -> None:
        super().__init__()
        self.layers = layers
        self.keep = frozenset(keep)
        for layer in layers:
            in_row_blocks(layer.mlp, ROW_BLOCK)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None):
        from transformers.modeling_outputs import BaseModelOutput

        states = []
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask)
            states.append(hidden_states if i in self.keep else None)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=tuple(states))


SHARED_KV = "s3d8_sdpa_shared_kv"
"""The attention the runtime's Mllama cross-attention layers run (:func:`sdpa_shared_kv`)."""


def sdpa_shared_kv(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, except that a prompt's queries read shared key/value heads through torch's own
    grouped-query SDPA (``enable_gqa``): transformers repeats the heads whenever a mask is given, for the 11B's
    cross-attention 4 copies of 6,404 image keys and values (0.2 GB at the peak of the prefill). The same numbers
    (tested); one query, or as many key as query heads, goes to transformers' function unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] == 1 or query.shape[1] == key.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _share_image_kv_heads(text: nn.Module) -> None:
    """Run ``text``'s cross-attention layers on :func:`sdpa_shared_kv` (a config of their own: the self-attention
    layers and the masks keep transformers' SDPA)."""
    from transformers import AttentionInterface

    AttentionInterface.register(SHARED_KV, sdpa_shared_kv)
    for layer in text.layers:
        if hasattr(layer, "cross_attn"):
            config = copy.copy(layer.cross_attn.config)
            config._attn_implementation = SHARED_KV
            layer.cross_attn.config = config


ROW_BLOCK = 1024
"""Tokens per block of the vision tower's products and MLPs and of the projector: the MLP's two 5,120-wide
intermediates (the product and the activation) are 1,024 x 5,120 floats each at a time instead of 6,432 x 5,120 (the
11B's four tiles: 0.26 GB at the peak of image encoding), and the native products' reused workspaces (quantised
activations, int32 sums: ``native._scratch``), which keep the size of the largest call, stay at a block's (the
projector's alone: 0.15 GB for 6,404 tokens)."""


def in_row_blocks(module: nn.Module, rows: int) -> None:
    """Make ``module`` run on its input a block of ``rows`` tokens at a time, into one output (its ``forward``
    wrapped in place, so its name and weights stay where they were): the same numbers where each token's result is
    its own (Linears on the native kernels, which scale each token's activations alone, and an activation), a
    block's intermediates in memory instead of the whole input's."""
    if getattr(module, "row_block", None) is not None:
        return
    whole = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= rows:
            return whole(x)
        first = whole(flat[:rows])
        out = first.new_empty(flat.shape[0], first.shape[-1])
        out[:rows] = first
        del first
        for i in range(rows, flat.shape[0], rows):
            out[i:i + rows] = whole(flat[i:i + rows])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    module.forward, module.row_block = forward, rows


def _return_large_frees() -> None:
    """glibc's malloc raises its mmap threshold (up to 32 MB) each time a large block is freed, and keeps the
    blocks freed below it in its heap: loading a large Mllama, whose validation decodes every weight in blocks of
    a few MB, and encoding an image, whose activations are tens of MB each, leave gigabytes of freed memory
    resident. The threshold fixed at 1 MB for this process makes a large block go back to the OS when freed."""
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)           # M_MMAP_THRESHOLD
    except (OSError, AttributeError):                     # not glibc: nothing to tune
        pass


def mllama_step(model, cache, positions: int, cross_attention_mask=None,
                stub_products: bool = False) -> decode_step.DecodeStep:
    """The C decoder of a packed Mllama (:func:`hf_mllama`) after its prompt filled ``cache``."""
    cfg = model.model.language_model.config
    inv_freq, scaling = _rotary(cfg.to_dict())
    cos, sin_rolled = decode_step.rope_tables(inv_freq, scaling, positions)
    return decode_step.mllama(model, cache, positions, cos, sin_rolled, cross_attention_mask, stub_products)
