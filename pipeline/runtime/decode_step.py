"""One decode token in one C call: the layer loop of a Llama or Mllama text decoder (``native/s3d8_decoder.c``).

:class:`DecodeStep` describes a model's tensors to the C decoder once (weights, norms, RoPE tables, the K/V caches,
a work area) and then runs ``step(token, pos) -> logits`` without a torch call per operation: embedding row,
RMSNorms, the products (S3D8, INT8 or bf16 on the library's kernels, one activation quantisation per input, the
products of one input in one parallel region), RoPE, attention over the cache, SiLU-gate, residuals, the final norm
and ``lm_head``. The runtime's prompt (prefill) path stays on torch and fills the same caches.

Its tokens are the runtime's torch path's (tested): the products, RoPE and the residuals are the same arithmetic to
the bit; the RMSNorm mean, SiLU's ``exp``, the softmax's ``exp`` (a polynomial, within 2 ulp) and the attention sums
are computed otherwise than torch's and may differ in the last bits. ``stub_products=True`` skips every product: the time left is the step's overhead, which
``pipeline.bench.generate`` reports.
"""

from __future__ import annotations

import torch

from pipeline import native
from pipeline.native import ffi, lib

ERRORS = {-1: "no usable kernel variant", -2: "a weight with more inputs than the int32 accumulators hold",
          -3: "an S3D8 centroid table with a negative value", -4: "inconsistent sizes or a position beyond the cache",
          -5: "token out of range"}


def _weight(w, module, what: str) -> list:
    """Fill the ``s3d8_weight`` ``w`` from a native Linear or row embedding (its ``decoder_weight``; ``what`` names
    it in errors); the tensors it points to."""
    name = type(module).__name__
    if not hasattr(module, "decoder_weight"):
        raise ValueError(f"C decoder: {what} ({name}) is not a native module (pipeline.native)")
    for key, t in module._buffers.items():
        if t is not None:
            native.check_readable(t, f"C decoder: {what} ({name}) buffer {key!r}")
    kind, (n, k), data, table, scale = module.decoder_weight()
    tensors = [t for t in (data, table, scale) if t is not None]
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"C decoder: {what} ({name}) needs contiguous tensors")
    w.kind, w.n, w.k, w.data = kind, n, k, ffi.cast("void *", data.data_ptr())
    w.table = ffi.NULL if table is None else ffi.cast("int8_t *", table.data_ptr())
    w.scale = ffi.NULL if scale is None else ffi.cast("uint16_t *", scale.data_ptr())
    return tensors


class DecodeStep:
    """The C decoder over a model's tensors. ``layers``: one dict per decoder layer with ``ln1``, ``ln2`` (float32
    norm weights), ``q k v o gate up down`` (native modules), ``k_cache``/``v_cache`` (float32 ``[kv heads, positions,
    head_dim]``, contiguous); a Mllama cross-attention layer adds ``cross=True``, ``q_norm``, ``bias`` (float32
    ``[positions]`` or None), ``attn_gate``, ``mlp_gate``, ``mlp_row_mask`` (floats, the gates through tanh), and
    ``skip=True`` leaves a layer out. ``cos``/``sin_rolled``: ``[positions, head_dim]`` (see ``LeanLlama._rope``).
    Every tensor is checked readable here (``native.check_readable``, errors name the layer); ``step`` then trusts
    them (it holds references to them; hundreds of checks per token would weigh on the decode's hot path)."""

    def __init__(self, *, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, layers: list[dict],
                 embed, lm_head, norm: torch.Tensor, cos: torch.Tensor, sin_rolled: torch.Tensor,
                 stub_products: bool = False) -> None:
        self._keep = []
        d = self.d = ffi.new("s3d8_decoder *")
        self._layers = ffi.new("s3d8_layer[]", max(len(layers), 1))
        d.n_layers, d.hidden, d.n_heads, d.n_kv_heads, d.head_dim = len(layers), hidden, n_heads, n_kv_heads, head_dim
        d.eps, d.layers, d.stub_products = eps, self._layers, int(stub_products)
        self._keep += _weight(d.embed, embed, "embed") + _weight(d.lm_head, lm_head, "lm_head")
        d.norm = self._floats(norm, "norm")
        d.cos, d.sin_rolled = self._floats(cos, "cos"), self._floats(sin_rolled, "sin_rolled")
        d.rope_len = cos.shape[0]
        for i, (c, spec) in enumerate(zip(self._layers, layers)):
            c.skip = int(spec.get("skip", False))
            if c.skip:
                continue
            c.ln1, c.ln2 = self._floats(spec["ln1"], f"layer {i} ln1"), self._floats(spec["ln2"], f"layer {i} ln2")
            c.cross = int(spec.get("cross", False))
            for name in ("q", "o", "gate", "up", "down") + (() if c.cross else ("k", "v")):
                self._keep += _weight(getattr(c, name), spec[name], f"layer {i} {name}")
            c.k_cache, c.v_cache = (self._floats(spec[k], f"layer {i} {k}") for k in ("k_cache", "v_cache"))
            c.cache_len = spec["k_cache"].shape[-2]
            if c.cross:
                c.q_norm = self._floats(spec["q_norm"], f"layer {i} q_norm")
                c.bias = ffi.NULL if spec.get("bias") is None else self._floats(spec["bias"], f"layer {i} bias")
                c.attn_gate, c.mlp_gate, c.mlp_row_mask = spec["attn_gate"], spec["mlp_gate"], spec["mlp_row_mask"]
        self.vocab = d.lm_head.n
        self.logits = torch.zeros(self.vocab)
        self._logits = ffi.cast("float *", self.logits.data_ptr())
        self._work = torch.zeros(lib.s3d8_decoder_work_bytes(d) + 64, dtype=torch.uint8)   # stubbed products read zeros
        d.work = ffi.cast("void *", (self._work.data_ptr() + 63) // 64 * 64)
        where = ffi.new("size_t *")
        rc = lib.s3d8_decoder_check(d, where)
        if rc:
            part = "the embedding or lm_head" if where[0] == len(layers) else f"layer {where[0]}"
            raise ValueError(f"C decoder: {ERRORS.get(rc, rc)} ({part})")

    def _floats(self, t: torch.Tensor, what: str):
        native.check_readable(t, f"C decoder: {what}")
        if t.dtype != torch.float32 or not t.is_contiguous():
            t = t.float().contiguous()
        self._keep.append(t)
        return ffi.cast("float *", t.data_ptr())

    def step(self, token: int, pos: int) -> torch.Tensor:
        """The logits (float32 ``[vocab]``, a buffer the next call overwrites) of ``token`` at position ``pos``;
        self-attention layers write their K/V at ``pos``."""
        rc = lib.s3d8_decoder_step(*native.call_settings(), self.d, token, pos, self._logits)
        if rc:
            raise ValueError(f"C decoder step (token {token}, position {pos}): {ERRORS.get(rc, rc)}")
        return self.logits


_BATCH_WORK: dict[str, torch.Tensor] = {}


def step_batch(steps: list[DecodeStep], tokens: list[int], positions: list[int]) -> list[torch.Tensor]:
    """One token for each of several sequences in one C call (``s3d8_decoder_step_batch``): ``steps`` are C
    decoders over the same weights (e.g. :meth:`LeanLlama.session`'s, or one Mllama's per request), each its own
    caches; every weight is read once for all of them. Returns each step's logits buffer (as :meth:`DecodeStep.step`
    does); a row's logits are its one-sequence step's (tested)."""
    if len(steps) == 1:
        return [steps[0].step(tokens[0], positions[0])]
    n = len(steps)
    need = int(lib.s3d8_decoder_batch_work_bytes(steps[0].d, n)) + 64
    work = _BATCH_WORK.get("work")
    if work is None or work.numel() < need:
        work = _BATCH_WORK["work"] = torch.empty(need, dtype=torch.uint8)
    ds = ffi.new("s3d8_decoder *[]", [s.d for s in steps])
    logits = ffi.new("float *[]", [s._logits for s in steps])
    rc = lib.s3d8_decoder_step_batch(*native.call_settings(), ds, n,
                                     ffi.new("int64_t[]", list(tokens)), ffi.new("size_t[]", list(positions)), logits,
                                     ffi.cast("void *", (work.data_ptr() + 63) // 64 * 64))
    if rc:
        raise ValueError(f"C decoder batch of {n} (tokens {list(tokens)[:8]}, positions {list(positions)[:8]}): "
                         f"{ERRORS.get(rc, rc)}" + (" or decoders that do not share their weights" if rc == -4 else ""))
    return [s.logits for s in steps]


def rope_tables(inv_freq: torch.Tensor, scaling: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin_rolled)`` ``[positions, head_dim]``: Hugging Face's RoPE tables, ``sin`` with its first half
    negated so that ``x * cos + roll(x, head_dim / 2) * sin_rolled`` is its ``x * cos + rotate_half(x) * sin``."""
    pos = torch.arange(positions, dtype=torch.float32)
    emb = torch.cat([pos[:, None] * inv_freq[None]] * 2, dim=-1)
    half = emb.shape[-1] // 2
    sin = emb.sin() * scaling
    return emb.cos() * scaling, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def _mlp(layer) -> dict:
    m = layer.mlp
    return {"ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
            "gate": m.gate_proj, "up": m.up_proj, "down": m.down_proj}


def mllama(model, cache, positions: int, cos: torch.Tensor, sin_rolled: torch.Tensor,
           cross_attention_mask: torch.Tensor | None = None, stub_products: bool = False) -> DecodeStep:
    """The C decoder of a Hugging Face Mllama (native Linear modules, row embedding) after a prompt: its
    self-attention K/V copied from ``cache`` into caches of ``positions``, the image's K/V of the cross-attention
    layers taken as they are (layers without them are skipped, as Hugging Face skips them), their score bias and
    row mask from ``cross_attention_mask`` (the prompt's last row, as the decode tokens get it)."""
    from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

    lm = model.model.language_model
    cfg = lm.config
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // nh
    bias = row_mask = None
    if cross_attention_mask is not None:
        bias, row_mask = _prepare_cross_attention_mask(cross_attention_mask[:, -1:], model.model.vision_model.num_patches,
                                                       torch.float32)
    layers = []
    for i, layer in enumerate(lm.layers):
        held = cache.layers[i]
        keys = held.keys if getattr(held, "is_initialized", False) else None
        if hasattr(layer, "cross_attn"):
            if keys is None or not keys.numel():
                layers.append({"skip": True})
                continue
            a = layer.cross_attn
            layers.append({**_mlp(layer), "cross": True, "q": a.q_proj, "o": a.o_proj, "q_norm": a.q_norm.weight,
                           "k_cache": keys[0].float().contiguous(), "v_cache": held.values[0].float().contiguous(),
                           "bias": None if bias is None else bias.reshape(-1),
                           "attn_gate": float(layer.cross_attn_attn_gate.tanh()),
                           "mlp_gate": float(layer.cross_attn_mlp_gate.tanh()),
                           "mlp_row_mask": 1.0 if row_mask is None else float(row_mask.reshape(-1)[0])})
            continue
        k, v = torch.zeros(nkv, positions, hd), torch.zeros(nkv, positions, hd)
        k[:, :keys.shape[-2]], v[:, :keys.shape[-2]] = keys[0], held.values[0]
        a = layer.self_attn
        layers.append({**_mlp(layer), "q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj,
                       "k_cache": k, "v_cache": v})
    return DecodeStep(hidden=cfg.hidden_size, n_heads=nh, n_kv_heads=nkv, head_dim=hd, eps=cfg.rms_norm_eps,
                      layers=layers, embed=lm.embed_tokens, lm_head=model.lm_head, norm=lm.norm.weight, cos=cos,
                      sin_rolled=sin_rolled, stub_products=stub_products)
