"""Generation runtime on packed models: every Linear on the native kernels, straight from the packed bytes.

Two kinds of packed file run here:

- the pipeline's packed S3D8 Mllama (``models/packed/s3d8/*.safetensors``, SPEC section 7): rebuilt by
  ``load_packed_model(path, kernel="native")`` (every Linear of the language and vision models, the
  projector and ``lm_head`` is a ``native.S3D8Linear``), its embedding swapped for
  :class:`S3D8RowEmbedding` (decodes only the looked-up rows);
- text-only Llama files (``pipeline/synthetic.py``: ``s3d8``, and the ``int8`` / ``bf16`` baselines),
  run by :class:`LeanLlama`, a small Llama decoder of our own over the packed tensors (or, with
  ``impl="hf"``, by Hugging Face's ``LlamaForCausalLM`` with the same native modules swapped in).

Generation, greedy or sampled (temperature, top-k, top-p, seeded), with a KV cache, two ways:

- ``impl="hf"``: Hugging Face ``generate`` (its ``DynamicCache``, logits processors, stopping criteria);
- ``impl="lean"`` (the default): our own loop. The prompt runs on torch (Llama files: our decoder with a
  preallocated float32 KV cache, RoPE tables and ``scaled_dot_product_attention``; Mllama files: the HF model,
  ``logits_to_keep=1``), then every decode token is one C call (:mod:`pipeline.decode_step`: the whole layer
  loop over the same weights and caches, no torch call per operation). ``pipeline/bench/generate.py`` measures
  both loops (``reports/bench_generate.md``).

``python -m pipeline.runtime MODEL_DIR --prompt "..." [--image PATH] [--max-new-tokens N] [--threads N]`` (a packed
model directory, or its ``model.safetensors``; ``s3d8 generate`` is the same command) prints the answer as it comes
(the stop token not printed) and tokens/s at the end. Its prompt is the one eval and teacher-generate give: the
chat template (which begins with BOS) tokenised without further special tokens, so greedy tokens equal Hugging
Face ``generate`` on the same model and input. ``--threads 0`` (the default) keeps torch's default thread count.
Exit status: 0, 1 for an error (one line on stderr: a bad model file, prompt or value), 2 for a command line that
cannot be parsed (argparse).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import decode_step, safetensors_io
from pipeline.layout import GROUP
from pipeline.safetensors_io import TORCH_DTYPES

IMPLS = ("lean", "hf")
DEFAULT_IMPL = "lean"


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
    """Every tensor read into private memory with plain reads (no mmap: resident memory is the file once)."""
    header, meta, base = read_header(path)
    out = {}
    with open(path, "rb", buffering=0) as f:
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = TORCH_DTYPES[e["dtype"]]
            t = torch.empty(e["shape"], dtype=dtype)
            a, b = e["data_offsets"]
            f.seek(base + a)
            view = memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
            got = f.readinto(view) if t.numel() else 0
            if got != b - a:
                raise RuntimeInputError(f"{path}: tensor {name!r} is truncated")
            out[name] = t
    return meta, out


def model_kind(path: str | Path) -> tuple[str, str]:
    """``("mllama" | "llama", format)`` of a packed file this runtime runs; RuntimeInputError otherwise."""
    _, meta, _ = read_header(path)
    fmt = meta.get("format")
    try:
        cfg = json.loads(meta.get("config", "null"))
    except ValueError:
        cfg = None
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type == "llama" and fmt in ("s3d8", "int8", "bf16"):
        return "llama", fmt
    if fmt == "s3d8" and model_type == "mllama":
        return "mllama", fmt
    raise RuntimeInputError(
        f"{path}: not a packed S3D8 model this runtime runs (metadata format={str(fmt)[:40]!r}, "
        f"model_type={str(model_type)[:40]!r}); it runs packed S3D8 Mllama files and the synthetic Llama "
        f"files (s3d8/int8/bf16); other packed formats run on torch: "
        f"pipeline.packed.load_packed_model(path, kernel='torch')")


# --- native layers -------------------------------------------------------------------------------------------

class S3D8RowEmbedding(nn.Module):
    """An S3D8 embedding that decodes only the looked-up rows from the packed bytes: the 3-row groups of
    the unique ids are gathered and decoded by the native kernel as one small weight, then scaled.
    Equal bit for bit to the rows of ``pipeline.formats.s3d8.decode`` (int8 value x bf16 scale in float32)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, shape,
                 padding_idx: int | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = shape
        cols = -(-self.embedding_dim // 16) * 16
        self.register_buffer("packed", packed.reshape(-1, cols))
        self.register_buffer("scale", scale.reshape(-1))
        self.register_buffer("table", table)
        self.padding_idx, self.dtype = padding_idx, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from pipeline import native
        n, d = self.num_embeddings, self.embedding_dim
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise IndexError(f"index out of range in self: ids in [{int(ids.min())}, {int(ids.max())}], {n} embeddings")
        flat = ids.reshape(-1)
        groups, inverse = torch.unique(flat // GROUP, return_inverse=True)
        decoded = native.s3d8_decode_int8(self.packed[groups].contiguous(), self.table, (GROUP * groups.numel(), d))
        rows = decoded[inverse * GROUP + flat % GROUP].float() * self.scale[flat].float()[:, None]
        return rows.to(self.dtype).reshape(*ids.shape, d)


class Int8RowEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.reshape(-1))
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    def forward(self, ids):
        flat = ids.reshape(-1)
        rows = self.weight[flat].float() * self.scale[flat].float()[:, None]
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)


class Bf16RowEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    def forward(self, ids):
        return self.weight[ids].to(self.dtype)


def _llama_modules(meta: dict, tensors: dict[str, torch.Tensor]):
    """``(config dict, format, linear(name) -> module, embedding module)`` of a synthetic Llama file."""
    from pipeline import native

    cfg, fmt = json.loads(meta["config"]), meta["format"]
    shapes = {k: tuple(v) for k, v in json.loads(meta["shapes"]).items()}

    def linear(name: str) -> nn.Module:
        if fmt == "s3d8":
            return native.S3D8Linear(tensors[f"{name}.packed"], tensors[f"{name}.scale"], tensors[f"{name}.table"],
                                     shapes[name])
        if fmt == "int8":
            return native.Int8Linear(tensors[f"{name}.int8"], tensors[f"{name}.scale"])
        return native.Bf16Linear(tensors[name])

    e = "model.embed_tokens.weight"
    if fmt == "s3d8":
        embed = S3D8RowEmbedding(tensors[f"{e}.packed"], tensors[f"{e}.scale"], tensors[f"{e}.table"], shapes[e])
    elif fmt == "int8":
        embed = Int8RowEmbedding(tensors[f"{e}.int8"], tensors[f"{e}.scale"])
    else:
        embed = Bf16RowEmbedding(tensors[e])
    return cfg, fmt, linear, embed


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
        cfg, self.format, linear, self.embed = _llama_modules(meta, tensors)
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
        self.lm_head = linear("lm_head.weight" if "lm_head.weight" in json.loads(meta["shapes"])
                              else "model.embed_tokens.weight")
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

    def native_step(self, stub_products: bool = False) -> decode_step.DecodeStep:
        """The C decoder over this model's weights and caches (``stub_products``: see :mod:`pipeline.decode_step`)."""
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
        up to ``end``: two small batched products, some 2x faster than SDPA's kernel here."""
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
        """One decode token in one C call (:mod:`pipeline.decode_step`) over the same weights and caches."""
        return self.native.step(int(ids), pos)

def hf_llama(path: str | Path):
    """Hugging Face ``LlamaForCausalLM`` over a synthetic packed file, the same native modules swapped in."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    meta, tensors = read_tensors(path)
    cfg, fmt, linear, embed = _llama_modules(meta, tensors)
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
    model.lm_head = linear("lm_head.weight" if "lm_head.weight" in tensors or "lm_head.weight.packed" in tensors
                           or "lm_head.weight.int8" in tensors else "model.embed_tokens.weight")
    model.model.rotary_emb = LlamaRotaryEmbedding(config)
    model.config.tie_word_embeddings = False      # the head is its own module over the same packed bytes
    model.weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    model.eval()
    return model


def hf_mllama(path: str | Path):
    """The packed S3D8 Mllama on the native kernels, embeddings decoding only the looked-up rows."""
    from pipeline.packed import load_packed_model
    from pipeline.packed_modules import LazyPackedEmbedding

    model = load_packed_model(path, kernel="native", decode="lazy")
    for name, module in list(model.named_modules()):
        if isinstance(module, LazyPackedEmbedding):
            t = module.packed_tensors
            new = S3D8RowEmbedding(t["packed"], t["scale"], t["table"], module.shape, module.padding_idx,
                                   module.weight_dtype)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, new)
    model.weight_bytes = Path(path).stat().st_size
    return model


def mllama_step(model, cache, positions: int, cross_attention_mask=None,
                stub_products: bool = False) -> decode_step.DecodeStep:
    """The C decoder of a packed Mllama (:func:`hf_mllama`) after its prompt filled ``cache``."""
    cfg = model.model.language_model.config
    inv_freq, scaling = _rotary(cfg.to_dict())
    cos, sin_rolled = decode_step.rope_tables(inv_freq, scaling, positions)
    return decode_step.mllama(model, cache, positions, cos, sin_rolled, cross_attention_mask, stub_products)


# --- generation --------------------------------------------------------------------------------------------------

@dataclass
class Sampling:
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> int:
    """The next token from float32 ``[vocab]`` logits: argmax, or a draw after temperature / top-k / top-p."""
    if s.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / max(s.temperature, 1e-6)
    if s.top_k and s.top_k < logits.numel():
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_l, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_l, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_l, -1) > s.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


@dataclass
class Result:
    tokens: list[int]
    prompt_tokens: int
    prefill_s: float               # prompt forward + first token
    decode_s: float                # the remaining tokens
    times: list[float] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s and len(self.tokens) > 1 else float("nan")


def _finish(tokens, prompt_tokens, t0, stamps) -> Result:
    if not stamps:
        return Result(tokens, prompt_tokens, 0.0, 0.0)
    return Result(tokens, prompt_tokens, stamps[0] - t0, stamps[-1] - stamps[0], stamps)


def lean_generate(model, inputs: dict, max_new_tokens: int, sampling: Sampling = Sampling(), *,
                  eos: set[int] | None = None, on_token=None) -> Result:
    """Our loop: a :class:`LeanLlama`, or an HF model (Mllama) driven directly with its cache."""
    gen = torch.Generator().manual_seed(sampling.seed)
    ids = inputs["input_ids"].reshape(-1)
    n = ids.numel()
    tokens, stamps = [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        if isinstance(model, LeanLlama):
            if n + max_new_tokens > model.max_len:
                model.allocate(n + max_new_tokens)
            logits = model.forward(ids, 0)

            def advance(tok: int, step: int) -> torch.Tensor:
                return model.forward(torch.tensor([tok]), n + step)
        else:
            kwargs = {k: v for k, v in inputs.items() if k != "attention_mask"}
            cam = kwargs.pop("cross_attention_mask", None)
            out = model(**kwargs, cross_attention_mask=cam, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1]
            native = mllama_step(model, out.cache, n + max_new_tokens, cam)

            def advance(tok: int, step: int) -> torch.Tensor:
                return native.step(tok, n + step)
        for step in range(max_new_tokens):
            tok = pick(logits, sampling, gen)
            tokens.append(tok)
            stamps.append(time.perf_counter())
            if on_token:
                on_token(tok)
            if (eos and tok in eos) or step == max_new_tokens - 1:
                break
            logits = advance(tok, step)
    return _finish(tokens, n, t0, stamps)


class _Stamps:
    """A ``generate`` streamer that records when each new token arrives (the first ``put`` is the prompt)."""

    def __init__(self, on_token=None) -> None:
        self.stamps, self.tokens, self.on_token, self._prompt = [], [], on_token, True

    def put(self, value):
        if self._prompt:
            self._prompt = False
            return
        self.stamps.append(time.perf_counter())
        for tok in value.reshape(-1).tolist():
            self.tokens.append(tok)
            if self.on_token:
                self.on_token(tok)

    def end(self):
        pass


def hf_generate(model, inputs: dict, max_new_tokens: int, sampling: Sampling = Sampling(), *,
                eos: set[int] | None = None, on_token=None) -> Result:
    """Hugging Face ``generate`` (``DynamicCache``) on an HF model, timed per token by a streamer."""
    if isinstance(model, LeanLlama):
        raise ValueError("hf_generate needs an HF model: load it with impl='hf'")
    streamer = _Stamps(on_token)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, use_cache=True, streamer=streamer,
                  pad_token_id=0)
    if sampling.greedy:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
        torch.manual_seed(sampling.seed)
    if eos:
        kwargs["eos_token_id"] = sorted(eos)
    else:
        kwargs.update(eos_token_id=None, min_new_tokens=max_new_tokens)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(**inputs, **kwargs)
    return _finish(streamer.tokens, int(inputs["input_ids"].shape[-1]), t0, streamer.stamps)


def generate(model, inputs: dict, max_new_tokens: int, sampling: Sampling = Sampling(), *, impl: str = DEFAULT_IMPL,
             eos: set[int] | None = None, on_token=None) -> Result:
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r}: expected one of {IMPLS}")
    fn = lean_generate if impl == "lean" or isinstance(model, LeanLlama) else hf_generate
    return fn(model, inputs, max_new_tokens, sampling, eos=eos, on_token=on_token)


def load(path: str | Path, impl: str = DEFAULT_IMPL, max_len: int | None = None):
    """The model of a packed file for ``impl``: a :class:`LeanLlama` (Llama, lean) or an HF model."""
    kind, _ = model_kind(path)
    if kind == "mllama":
        return hf_mllama(path)
    return LeanLlama(path, max_len) if impl == "lean" else hf_llama(path)


def context_length(model) -> int:
    if isinstance(model, LeanLlama):
        return model.context
    cfg = model.config
    cfg = getattr(cfg, "text_config", cfg)
    return int(cfg.max_position_embeddings)


# --- CLI -------------------------------------------------------------------------------------------------------------

def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:        # pragma: no cover - not Linux
        return os.cpu_count() or 1


def packed_file(path: str | Path) -> Path:
    """The packed file of ``path``: the file itself, or a packed model directory's ``model.safetensors`` (what
    pack-safetensors writes beside the config and processor files)."""
    path = Path(path)
    if not path.is_dir():
        return path
    if (path / "model.safetensors").is_file():
        return path / "model.safetensors"
    found = sorted(p.name for p in path.glob("*.safetensors"))
    raise RuntimeInputError(f"{path}: a packed model directory holds model.safetensors; found "
                            f"{', '.join(found) if found else 'no .safetensors file'}")


def _processor_for(path: Path, meta: dict[str, str], tokenizer: str | None):
    from pipeline.models import load_processor

    beside = path.parent if any((path.parent / f).is_file() for f in ("processor_config.json", "tokenizer_config.json")) \
        else None
    source = tokenizer or beside or meta.get("source_model")
    if source and Path(source).exists():
        return load_processor(str(source))
    return None


def _inputs(kind: str, processor, prompt: str, image: str | None, vocab: int) -> tuple[dict, object]:
    if kind == "llama" and image:
        raise RuntimeInputError("--image: this model is a text-only Llama; images need an Mllama file")
    if kind == "llama" and processor is None:
        # no tokenizer ships with a synthetic model: UTF-8 bytes are the tokens (ids 3..258) after BOS 1
        ids = [1] + [3 + b for b in prompt.encode()]
        if max(ids) >= vocab:
            raise RuntimeInputError(f"--prompt: byte tokens need a vocabulary of 259, the model has {vocab}")
        return {"input_ids": torch.tensor([ids])}, lambda tokens: "".join(f"<{t}>" for t in tokens)
    if processor is None:
        raise RuntimeInputError("no tokenizer: no processor files beside the packed file and its 'source_model' is "
                                "not a local directory; pass --tokenizer DIR")
    from pipeline.chat import chat_prompt, tokenizer_of

    tokenizer = tokenizer_of(processor)
    if image:
        from PIL import Image
        try:
            img = Image.open(image).convert("RGB")
        except (OSError, ValueError) as e:
            raise RuntimeInputError(f"--image {image}: cannot read it as an image ({e})") from None
        text = chat_prompt(processor, prompt)     # begins with BOS: the processor must not add another
        inputs = dict(processor(images=[img], text=[text], return_tensors="pt", add_special_tokens=False))
    elif tokenizer is processor:                  # a text-only model: its chat template over the text turn
        text = chat_prompt(processor, prompt)
        inputs = dict(processor([text], return_tensors="pt", add_special_tokens=False))
    else:
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = dict(processor(text=[text], return_tensors="pt", add_special_tokens=False))
    inputs = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    return inputs, lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)


def eos_ids(model, processor) -> set[int]:
    """The stop tokens: the generation config's ``eos_token_id``, the tokenizer's EOS and, where the vocabulary
    has it, Llama 3's ``<|eot_id|>`` (what teacher-generate, eval and the CLI stop at)."""
    from pipeline.chat import tokenizer_of

    tokenizer = tokenizer_of(processor)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    extra = [tokenizer.eos_token_id, tokenizer.get_vocab().get("<|eot_id|>")]
    return {int(e) for e in eos + extra if e is not None}


class TextStream:
    """Prints generated tokens as text as they come, as ``detok(tokens)`` of all so far (a character split
    over tokens is printed once complete); stop tokens are not printed."""

    def __init__(self, detok, stop: set[int], out=None) -> None:
        self.detok, self.stop, self.out = detok, stop, out or sys.stdout
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, token: int) -> None:
        if token in self.stop:
            return
        self.tokens.append(token)
        text = self.detok(self.tokens)
        if not text.endswith("\ufffd"):
            self._emit(text)

    def _emit(self, text: str) -> None:
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text

    def close(self) -> None:
        self._emit(self.detok(self.tokens) if self.tokens else self.printed)
        self.out.write("\n")
        self.out.flush()


def check_threads(threads: int, flag: str = "--threads") -> int:
    """``threads`` of a command line, the same meaning everywhere: 0 leaves torch's default, 1 .. the CPUs
    this process may use sets it; anything else is a RuntimeInputError. Returns the count that holds."""
    cpus = available_cpus()
    if not 0 <= threads <= cpus:
        raise RuntimeInputError(f"{flag} {threads}: use 0 (torch's default) or 1..{cpus} (the CPUs this process "
                                f"may use)")
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


THREADS_HELP = "threads (default 0: torch's default; at most the CPUs this process may use)"


def build_parser(prog: str = "python -m pipeline.runtime") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Generate with a packed S3D8 model on the native kernels: "
                                 "the answer on stdout as it comes, tokens/s on stderr.",
                                 epilog="Exit status: 0 done, 1 an error (one line on stderr), 2 a command line "
                                        "that cannot be parsed.")
    ap.add_argument("model", help="packed model directory (pack-safetensors' output) or its .safetensors file")
    ap.add_argument("--prompt", required=True, help="the user's message (sent through the chat template)")
    ap.add_argument("--image", help="an image file (Mllama models)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    ap.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    ap.add_argument("--impl", choices=IMPLS, default=DEFAULT_IMPL,
                    help=f"generation loop: lean (ours) or hf (Hugging Face generate); default {DEFAULT_IMPL}")
    ap.add_argument("--sample", action="store_true", help="sample instead of greedy")
    ap.add_argument("--temperature", type=float, default=0.8, help="with --sample (default 0.8)")
    ap.add_argument("--top-k", type=int, default=0, help="with --sample: keep the k likeliest tokens (default 0: all)")
    ap.add_argument("--top-p", type=float, default=0.95, help="with --sample: nucleus mass kept (default 0.95)")
    ap.add_argument("--seed", type=int, default=0, help="with --sample: the random seed (default 0)")
    ap.add_argument("--tokenizer", help="processor directory (default: beside the model, or its source_model)")
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.runtime") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        if args.max_new_tokens < 1:
            raise RuntimeInputError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
        if args.sample and (args.temperature <= 0 or args.top_k < 0 or not 0 < args.top_p <= 1):
            raise RuntimeInputError(f"--temperature {args.temperature} / --top-k {args.top_k} / --top-p {args.top_p}: "
                                    f"expected temperature > 0, top-k >= 0, 0 < top-p <= 1")
        threads = check_threads(args.threads)
        path = packed_file(args.model)
        kind, fmt = model_kind(path)
        _, meta, _ = read_header(path)
        processor = _processor_for(path, meta, args.tokenizer)    # None: a synthetic Llama (byte tokens)
        cfg = json.loads(meta["config"])
        vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size", 0)
        inputs, detok = _inputs(kind, processor, args.prompt, args.image, vocab)
        n = int(inputs["input_ids"].shape[-1])
        ctx = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
        if ctx and n + args.max_new_tokens > ctx:
            raise RuntimeInputError(f"--prompt: {n} prompt tokens + {args.max_new_tokens} new tokens exceed the "
                                    f"model's context of {ctx} tokens")
        try:
            model = load(path, args.impl, max_len=n + args.max_new_tokens)
        except (ValueError, KeyError, OSError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise RuntimeInputError(msg if str(path) in msg
                                    else f"{path}: cannot load the packed model ({msg})") from None
    except (ValueError, OSError) as e:         # RuntimeInputError, and what reading the files raises
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    eos = {t for t in model.eos if t is not None} if isinstance(model, LeanLlama) else set()
    if processor is not None and hasattr(model, "generation_config"):
        eos |= eos_ids(model, processor)
    elif processor is not None:
        from pipeline.chat import tokenizer_of

        eos |= {t for t in (tokenizer_of(processor).eos_token_id,) if t is not None}
    sampling = Sampling(greedy=not args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed)
    stream = TextStream(detok, eos)
    res = generate(model, inputs, args.max_new_tokens, sampling, impl=args.impl, eos=eos, on_token=stream)
    stream.close()
    print(f"[{kind} {fmt}, {args.impl}, {threads} thread(s)] prompt {res.prompt_tokens} tokens: "
          f"{res.prefill_tokens_per_s:.1f} tokens/s; {res.new_tokens} new tokens: "
          f"{res.decode_tokens_per_s:.2f} tokens/s after the first", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
