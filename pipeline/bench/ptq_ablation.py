"""What each step of the post-training cast buys on a real model: ``s3d8 pack`` run once per variant, each packed
model compared with its source on held-out prose (KL per token, perplexity), bits per weight counted two ways
(the whole model; the decoder Linears alone, the paper's accounting). Writes ``reports/ptq_ablation.{json,md}``.

    python -m pipeline.bench.ptq_ablation --model data/teacher-smollm2 [--variants all-s3d8,int8-embedding,rotated]

Variants (each one change on top of the sequential GPTQ cast on the prose corpus' calibration half):

- ``all-s3d8``: every matrix S3D8, the tied embedding / output head cast with ``lm_head``'s ``X^T X``;
- ``int8-embedding``: ``s3d8 pack``'s defaults, the token embedding (and a tied head) INT8;
- ``rotated``: the residual stream rotated first (``--rotate orthogonal``: the head untied, S3D8 by GPTQ), the
  token embedding INT8.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "all-s3d8": ["--precision", "none"],
    "int8-embedding": [],
    "rotated": ["--rotate", "orthogonal"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.bench.ptq_ablation", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the source model directory (a text Llama)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--out", default="reports", help="report folder (default %(default)s)")
    args = ap.parse_args(argv)
    chosen = args.variants.split(",")
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")

    import torch

    from pipeline.bench import machine
    from pipeline.bench.llama_cpp_files import packed_census
    from pipeline.cli import build_parser, pack_model

    torch.set_num_threads(machine.describe()["usable_cpus"])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            out = Path(tmp) / name
            ns = build_parser().parse_args(["pack", args.model, str(out), *VARIANTS[name]])
            began = time.perf_counter()
            result = pack_model(ns)
            census = packed_census(out / "model.safetensors")
            rows.append({"variant": name, "arguments": VARIANTS[name], "plan": result["plan"],
                         "bits_per_weight": census["bits_per_weight"],
                         "bits_per_weight_linears": census["bits_per_weight_linears"],
                         "file_bytes": census["file_bytes"], **{k: result["held_out"][k] for k in
                                                                ("kl", "perplexity", "teacher_perplexity", "tokens")},
                         "cast_s": round(result["seconds"], 1), "total_s": round(time.perf_counter() - began, 1)})
    report = {"model": args.model, "machine": machine.describe(), "rows": rows,
              "held_out": "python-language-reference-prose, held-out half (s3d8 pack's final line)",
              "calibration": "16 windows of 512 tokens of the corpus' other half (s3d8 pack's default)"}
    out_dir = Path(args.out)
    (out_dir / "ptq_ablation.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# Post-training cast, step by step: {Path(args.model).name}", "",
             f"Machine: {machine.line(report['machine'])}; held-out {report['held_out']}; calibration "
             f"{report['calibration']}. Bits per weight: the whole model (every matrix, tied head once) / the "
             "decoder Linears alone.", "",
             "| variant | plan | bits/weight whole / linears | MB | KL | perplexity (source) | x source | cast s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['plan']} | {r['bits_per_weight']:.2f} / {r['bits_per_weight_linears']:.2f}"
                     f" | {r['file_bytes'] / 1e6:.1f} | {r['kl']:.4f} | {r['perplexity']:.2f} "
                     f"({r['teacher_perplexity']:.2f}) | {r['perplexity'] / r['teacher_perplexity']:.2f} | "
                     f"{r['cast_s']:.0f} |")
    (out_dir / "ptq_ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
