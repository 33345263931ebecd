"""Synthetic Llama 3.2 1B- and 3B-class text decoders for end-to-end speed measurements.

Seeded random weights drawn to look trained: every 2-D weight is ``Student-t(df=5)`` noise
(heavy tails, unit variance) times a per-row scale that varies log-normally (sigma 0.5) around the
usual ``0.02`` init, times a milder log-normal per-column factor (sigma 0.2: the few large input
channels of trained models); norms are ``1 + N(0, 0.05)``. Nothing here was trained, so the models
generate gibberish: they exist to measure tokens/s, memory and bandwidth at the real shapes.

The same weights are written in three files, in one streaming pass over row blocks (the fp32 model is
never in memory: at most one block of ``BLOCK_ELEMS`` weights plus one tensor's output bytes):

- ``s3d8.safetensors``: SPEC section 7 (``P.weight.packed`` / ``.scale`` / ``.table``), every Linear and
  the (tied) embedding; one centroid table per model, fitted on a sample of the first attention weight
  (every matrix is drawn from the same family; the format allows a table per matrix);
- ``int8.safetensors``: per-channel symmetric INT8 (``P.weight.int8`` int8 ``[d_out, d_in]`` and
  ``P.weight.scale`` bf16 ``[d_out, 1]``, scale ``absmax / 127``), for ``native.int8_matmul``;
- ``bf16.safetensors``: ``P.weight`` in bf16, for ``native.bf16_matmul``.

Norm weights are stored in float32 in all three. Metadata: ``format``, ``layout``, ``config`` (a
``LlamaConfig`` dict), ``shapes``, ``synthetic`` (preset, seed). ``write_gguf`` writes the bf16 file as a
GGUF (llama.cpp's tensor names, Q/K rows permuted as llama.cpp's converter does) for llama.cpp's own
quantizer. ``python -m pipeline.synthetic synthetic-1b [--out DIR] [--gguf]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import zlib
from pathlib import Path

import torch

from pipeline import formats as formats_registry
from pipeline.teacher import gguf_import
from pipeline.packed import layout
from pipeline.formats import FormatBase
from pipeline.packed.safetensors_io import StreamingWriter

BLOCK_ELEMS = 1 << 25          # weights generated at a time (128 MiB of float32)
STUDENT_DF = 5.0
ROW_SIGMA, COL_SIGMA, BASE_STD = 0.5, 0.2, 0.02
FORMATS = (formats_registry.SUBJECT, formats_registry.INT8_BASELINE, formats_registry.BF16_BASELINE)
DEFAULT_DIR = Path("models/synthetic")

_LLAMA32 = dict(max_position_embeddings=131072, rms_norm_eps=1e-5, vocab_size=128256, tie_word_embeddings=True,
                bos_token_id=128000, eos_token_id=128001, hidden_act="silu",
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
PRESETS: dict[str, dict] = {
    "synthetic-1b": dict(_LLAMA32, num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "synthetic-3b": dict(_LLAMA32, num_hidden_layers=28, hidden_size=3072, intermediate_size=8192,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128),
    # for tests: the same code path at toy size
    "synthetic-tiny": dict(_LLAMA32, num_hidden_layers=2, hidden_size=96, intermediate_size=192,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=300,
                           max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                           rope_parameters=dict(_LLAMA32["rope_parameters"], original_max_position_embeddings=256)),
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def llama_config(preset: str | dict):
    from transformers import LlamaConfig

    cfg = PRESETS[preset] if isinstance(preset, str) else preset
    return LlamaConfig(**cfg)


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint names (Hugging Face ``LlamaForCausalLM``) and shapes, in file order."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    dims = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        for lin in LINEARS:
            out[f"{p}.{lin}.weight"] = dims[lin.rpartition(".")[2]]
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", True):
        out["lm_head.weight"] = (cfg["vocab_size"], h)
    return out


class Synth:
    """Deterministic generator of one tensor, row block by row block (seeded by the tensor's name)."""

    def __init__(self, name: str, shape: tuple[int, ...], seed: int) -> None:
        self.name, self.shape = name, shape
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if len(shape) == 2:
            d_out, d_in = shape
            self.row = BASE_STD * torch.exp(ROW_SIGMA * torch.randn(d_out, generator=self.gen))
            self.col = torch.exp(COL_SIGMA * torch.randn(d_in, generator=self.gen))
            self.pool = 2 * torch._standard_gamma(torch.full((1 << 16,), STUDENT_DF / 2), generator=self.gen)

    def vector(self) -> torch.Tensor:
        return 1 + 0.05 * torch.randn(self.shape, generator=self.gen)

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0 .. r1`` (call in order): Student-t (df 5, unit variance) x row scale x column factor.
        A chi-square pool of 65,536 draws per tensor stands in for per-element chi-square draws (speed)."""
        n = (r1 - r0) * self.shape[1]
        z = torch.randn(n, generator=self.gen)
        chi = self.pool[torch.randint(0, self.pool.numel(), (n,), generator=self.gen)]
        t = z.mul_(chi.div_(STUDENT_DF).rsqrt_()).mul_(math.sqrt((STUDENT_DF - 2) / STUDENT_DF))
        return t.view(r1 - r0, -1).mul_(self.row[r0:r1, None]).mul_(self.col)


def block_rows(shape: tuple[int, int]) -> int:
    return max(layout.GROUP, BLOCK_ELEMS // shape[1] // layout.GROUP * layout.GROUP)


def _specs(fmt: FormatBase, state: dict, shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, torch.dtype, tuple]]:
    """The file's tensors: norms in float32, 2-D weights as ``fmt`` stores them."""
    out = []
    for name, shape in shapes.items():
        if len(shape) == 1:
            out.append((name, torch.float32, shape))
            continue
        names = fmt.stored_names(name)
        out += [(names[s], dt, tuple(sh)) for s, (dt, sh) in fmt.packed_specs(shape, state).items()]
    return out


class WeightWriter:
    """One weight of one file from its row blocks: its format's first stored tensor streamed block by block, the
    others (row scales: concatenated; a table: written once) after it."""

    def __init__(self, writer: StreamingWriter, fmt: FormatBase, state: dict, name: str, shape) -> None:
        self.writer, self.fmt, self.state = writer, fmt, state
        self.names, self.specs = fmt.stored_names(name), fmt.packed_specs(shape, state)
        self.held: dict[str, list[torch.Tensor]] = {s: [] for s in list(self.specs)[1:]}

    def block(self, block: torch.Tensor) -> None:
        t = self.fmt.pack(block, self.state)
        first = next(iter(self.specs))
        self.writer.write_part(self.names[first], t[first])
        for s in self.held:
            self.held[s].append(t[s])

    def finish(self) -> None:
        for s, parts in self.held.items():
            rows = sum(p.shape[0] for p in parts)
            self.writer.write(self.names[s], torch.cat(parts) if rows == self.specs[s][1][0] else parts[0])


def stream_blocks(s: "Synth", shape: tuple[int, int], parts: list["WeightWriter"]) -> None:
    """One weight drawn a row block at a time, each block packed by every file's writer, then their other tensors."""
    rows = block_rows(shape)
    for r0 in range(0, shape[0], rows):        # a block drawn once, packed in every format
        block = s.rows(r0, min(r0 + rows, shape[0]))
        for part in parts:
            part.block(block)
        del block
    for part in parts:
        part.finish()


def write_synthetic(preset: str, out_dir: str | Path = DEFAULT_DIR, *, seed: int = 0,
                    formats: tuple[str, ...] = FORMATS, progress=None) -> dict[str, Path]:
    """Write ``out_dir/<preset>/<fmt>.safetensors`` for each format in one pass; returns the paths."""
    cfg = llama_config(preset).to_dict() if isinstance(preset, str) else preset
    name = preset if isinstance(preset, str) else "custom"
    cfg["architectures"] = ["LlamaForCausalLM"]
    shapes = tensor_shapes(cfg)
    folder = Path(out_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    paths = {f: folder / f"{f}.safetensors" for f in formats}
    fmts = {f: formats_registry.get(f) for f in formats}
    first = "model.layers.0.self_attn.q_proj.weight"      # one state per model (S3D8: a table), fitted on a sample
    sample = Synth(first, shapes[first], seed).rows(0, min(shapes[first][0], 96))    # of the first attention weight
    states = {f: fmt.fit(sample, seed=seed) for f, fmt in fmts.items()}
    writers = {}
    for f, fmt in fmts.items():
        meta = {"format": f, "layout": fmt.layout or f,       # bf16: no layout of its own, its weights as they are
                "config": json.dumps(cfg, sort_keys=True, default=str),
                "shapes": json.dumps({k: list(v) for k, v in shapes.items() if len(v) == 2}, sort_keys=True),
                "synthetic": json.dumps({"preset": name, "seed": seed, "student_df": STUDENT_DF,
                                         "row_sigma": ROW_SIGMA, "col_sigma": COL_SIGMA, "base_std": BASE_STD}),
                **fmt.file_metadata()}
        writers[f] = StreamingWriter(paths[f], _specs(fmt, states[f], shapes), meta)
    ok = False
    try:
        for tname, shape in shapes.items():
            if progress:
                progress(tname)
            s = Synth(tname, shape, seed)
            if len(shape) == 1:
                v = s.vector()
                for w in writers.values():
                    w.write(tname, v)
                continue
            stream_blocks(s, shape, [WeightWriter(w, fmts[f], states[f], tname, shape) for f, w in writers.items()])
        ok = True
    finally:
        for w in writers.values():
            w.close() if ok else w.abort()
    return paths


# --- GGUF for llama.cpp -------------------------------------------------------------------------------------

def _rope_freq_factors(cfg: dict):
    import numpy as np

    rp = cfg.get("rope_parameters") or {}
    if rp.get("rope_type") != "llama3":
        return None
    dim, base = cfg["head_dim"], rp["rope_theta"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wl = rp["original_max_position_embeddings"] / rp["low_freq_factor"]
    high_wl = rp["original_max_position_embeddings"] / rp["high_freq_factor"]
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(rp["factor"])
        else:
            smooth = (rp["original_max_position_embeddings"] / wl - rp["low_freq_factor"]) / (
                rp["high_freq_factor"] - rp["low_freq_factor"])
            out.append(1 / ((1 - smooth) / rp["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(bf16_path: str | Path, out: str | Path) -> Path:
    """The bf16 synthetic file as a GGUF (``gguf`` package; llama.cpp names, a vocabulary of placeholder
    tokens so llama.cpp loads it). Tensor by tensor: memory is one tensor."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    out = Path(out)
    with safe_open(str(bf16_path), "pt") as f:
        cfg = json.loads(f.metadata()["config"])
        shapes = tensor_shapes(cfg)
        writer = gguf.GGUFWriter(str(out) + ".tmp", "llama")
        writer.add_name("synthetic")
        writer.add_block_count(cfg["num_hidden_layers"])
        writer.add_context_length(cfg["max_position_embeddings"])
        writer.add_embedding_length(cfg["hidden_size"])
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_head_count(cfg["num_attention_heads"])
        writer.add_head_count_kv(cfg["num_key_value_heads"])
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
        writer.add_rope_dimension_count(cfg["head_dim"])
        writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
        n = cfg["vocab_size"]
        writer.add_tokenizer_model("llama")
        writer.add_token_list([f"<t{i}>".encode() for i in range(n)])
        writer.add_token_scores([0.0] * n)
        writer.add_token_types([gguf.TokenType.NORMAL] * n)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
        sub = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
        plan = []
        factors = _rope_freq_factors(cfg)
        if factors is not None:
            plan.append(("rope_freqs.weight", None, factors))
        for name, shape in shapes.items():
            if name in names:
                g = names[name]
            else:
                i = int(name.split(".")[2])
                g = f"blk.{i}.{sub[name.split('.', 3)[3].rsplit('.', 1)[0]]}.weight"
            plan.append((g, name, None))
        for g, name, arr in plan:
            if arr is not None:
                writer.add_tensor_info(g, arr.shape, arr.dtype, arr.nbytes)
                continue
            gguf_import.add_bf16_tensor_info(writer, g, shapes[name])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for g, name, arr in plan:
            if arr is None:
                heads = (cfg["num_attention_heads"] if ".q_proj." in name
                         else cfg["num_key_value_heads"] if ".k_proj." in name else None)
                arr = gguf_import.bf16_gguf_array(f.get_tensor(name), heads)
            writer.write_tensor_data(np.ascontiguousarray(arr))
        writer.close()
    os.replace(str(out) + ".tmp", out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.synthetic", description=__doc__.split("\n")[0])
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("--out", default=str(DEFAULT_DIR))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--gguf", action="store_true", help="also write <preset>/bf16.gguf (needs the gguf package)")
    args = ap.parse_args(argv)
    paths = write_synthetic(args.preset, args.out, seed=args.seed, formats=tuple(args.formats.split(",")),
                            progress=lambda n: print(n, flush=True) if n.endswith("q_proj.weight") else None)
    for f, p in paths.items():
        print(f"{f}: {p} ({p.stat().st_size / 1e6:.1f} MB)")
    if args.gguf:
        print(write_gguf(paths[formats_registry.BF16_BASELINE], Path(args.out) / args.preset / "bf16.gguf"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
