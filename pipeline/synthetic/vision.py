"""``synthetic-11b-vision``: every tensor of Llama 3.2 11B Vision Instruct at its real shape (the vision tower's 32
local and 8 global layers, the projector, 40 text layers of which 8 cross-attention, the 128,264-row embedding and
the untied ``lm_head``), seeded trained-looking weights (:class:`pipeline.synthetic.Synth`: Student-t noise, log-normal
row and column scales) written straight into packed files, for speed and memory measured at the real shape.

Each file is a packed model as pack-safetensors writes it (SPEC section 7: ``format``, ``layout``, ``shapes``, the
precision plan's ``formats``, the Mllama ``config``), so ``pipeline.runtime.generation`` and ``load_packed_model`` run it like
any other: ``s3d8.safetensors`` under the default precision plan (every Linear S3D8, the token embedding INT8),
``int8.safetensors`` (every quantised weight INT8, the baseline). The weights that are not quantised (norms, biases,
gates, the vision tower's patch and position embeddings) are stored in bf16, as pack-safetensors stores them. Writing streams
row blocks (``pipeline.synthetic.block_rows``): one block of a few million weights and one tensor's packed bytes
are held at a time, never the model. The processor (``pipeline.synthetic.shape.build_processor``) is saved beside the
files, so that ``s3d8 generate DIR/s3d8.safetensors --image ...`` tiles a picture as the 11B's processor does.

``python -m pipeline.synthetic.vision [synthetic-11b-vision|synthetic-vision-tiny] [--out models/synthetic]``
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from pipeline import formats as registry
from pipeline.synthetic.shape import Size, build_processor, skeleton_config
from pipeline.formats.precision import KEEP, Precision
from pipeline.packed.safetensors_io import StreamingWriter
from pipeline.synthetic.text import BASE_STD, COL_SIGMA, DEFAULT_DIR, ROW_SIGMA, STUDENT_DF, Synth, WeightWriter, stream_blocks

PRESETS = {
    "synthetic-11b-vision": Size(text_layers=40, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38],
                                 vision_layers=32, vision_global_layers=8, intermediate_layers_indices=[3, 7, 15, 23, 30]),
    # the same code path at toy size (tests)
    "synthetic-vision-tiny": Size(vocab_size=1024, text_hidden=64, text_intermediate=128, text_heads=4, text_kv_heads=2,
                                  text_layers=3, cross_attention_layers=[1], vision_hidden=32, vision_intermediate=64,
                                  vision_heads=2, vision_layers=2, vision_global_layers=1,
                                  intermediate_layers_indices=[0, 0, 1, 1, 1], image_size=56, max_num_tiles=4),
}
FILES = {registry.SUBJECT: (registry.SUBJECT, {"embed_tokens$": registry.INT8_BASELINE}),
         registry.INT8_BASELINE: (registry.INT8_BASELINE, {})}
"""File stem -> (main format, precision rules): the default plan's S3D8 model and the INT8 baseline."""


def tensors(config) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """``({checkpoint name: shape}, {checkpoint names of the weights the recipe quantises})`` of an Mllama config,
    from the model on the ``meta`` device."""
    from pipeline.models import checkpoint_names, meta_model, quantised_weight_names

    model = meta_model(config)
    names = checkpoint_names(model)
    shapes = {names.get(n, n): tuple(p.shape) for n, p in model.state_dict(keep_vars=True).items()
              if not n.endswith("inv_freq")}
    return dict(sorted(shapes.items())), set(quantised_weight_names(model).values())


def _vector(s: Synth, name: str) -> torch.Tensor:
    """1-D tensors: biases small, everything else (norm weights, gates, class embedding) near 1."""
    v = s.vector()
    return (v - 1) * (BASE_STD / 0.05) if name.endswith(".bias") else v


def write_vision(preset: str | Size, out_dir: str | Path = DEFAULT_DIR, *, files=tuple(FILES), seed: int = 0,
                 progress=None) -> dict[str, Path]:
    """Write ``out_dir/<preset>/<file>.safetensors`` for each of ``files`` (keys of :data:`FILES`) in one pass over
    the weights, and the processor beside them; returns the paths."""
    size = PRESETS[preset] if isinstance(preset, str) else preset
    name = preset if isinstance(preset, str) else "custom"
    config = skeleton_config(size)
    shapes, quantised = tensors(config)
    folder = Path(out_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    paths = {f: folder / f"{f}.safetensors" for f in files}
    plans = {f: Precision(registry.get(FILES[f][0]), FILES[f][1]) for f in files}
    keep = registry.get(KEEP)                      # what is not quantised: stored as it is
    first = next(n for n in shapes if n in quantised and ".self_attn.q_proj" in n and "language_model" in n)
    sample = Synth(first, shapes[first], seed).rows(0, min(shapes[first][0], 96))
    fmt_of = {f: {n: (plans[f].format_of(n.removesuffix(".weight")) if n in quantised else None) for n in shapes}
              for f in files}
    used = {fmt.name: fmt for of in fmt_of.values() for fmt in of.values() if fmt is not None}
    states = {k: fmt.fit(sample, seed=seed) for k, fmt in used.items()}      # one state (S3D8: a table) a format
    writers = {}
    for f in files:
        specs, packed = [], {}
        for n, shape in shapes.items():
            fmt = fmt_of[f][n]
            if fmt is None:
                specs.append((n, torch.bfloat16, shape))
            else:
                packed[n] = fmt
                names = fmt.stored_names(n)
                specs += [(names[s], dt, tuple(sh)) for s, (dt, sh) in fmt.packed_specs(shape, states[fmt.name]).items()]
        main = plans[f].default
        meta = {"format": main.name, "layout": main.layout, "format_version": "1",
                "shapes": json.dumps({n: list(shapes[n]) for n in packed}, sort_keys=True),
                "formats": json.dumps({n: fm.name for n, fm in packed.items() if fm is not main}, sort_keys=True),
                "config": json.dumps(config.to_dict(), sort_keys=True, default=str), "method": "synthetic",
                "synthetic": json.dumps({"preset": name, "seed": seed, "student_df": STUDENT_DF, "row_sigma": ROW_SIGMA,
                                         "col_sigma": COL_SIGMA, "base_std": BASE_STD, "plan": FILES[f][1]}),
                **main.file_metadata()}
        writers[f] = StreamingWriter(paths[f], specs, meta)
    ok = False
    try:
        for n, shape in shapes.items():
            if progress:
                progress(n)
            s = Synth(n, (shape[0], math.prod(shape[1:])) if len(shape) > 1 else shape, seed)
            if len(shape) == 1:
                v = _vector(s, n)
                for w in writers.values():
                    w.write(n, v.to(torch.bfloat16))
                continue
            flat = (shape[0], math.prod(shape[1:]))
            stream_blocks(s, flat, [WeightWriter(w, fmt_of[f][n] or keep, states.get((fmt_of[f][n] or keep).name, {}),
                                                  n, flat) for f, w in writers.items()])
        ok = True
    finally:
        for w in writers.values():
            w.close() if ok else w.abort()
    build_processor(size).save_pretrained(folder)
    config.save_pretrained(folder)                 # the processor's loader reads the model's config beside it
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.synthetic.vision", description=__doc__.split("\n")[0])
    ap.add_argument("preset", choices=sorted(PRESETS), nargs="?", default="synthetic-11b-vision")
    ap.add_argument("--out", default=str(DEFAULT_DIR), help=f"directory (default {DEFAULT_DIR})")
    ap.add_argument("--files", default=",".join(FILES), help=f"which files (default {','.join(FILES)})")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    paths = write_vision(args.preset, args.out, files=tuple(args.files.split(",")), seed=args.seed,
                         progress=lambda n: print(n, flush=True) if n.endswith("q_proj.weight") else None)
    for f, p in paths.items():
        print(f"{f}: {p} ({p.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
