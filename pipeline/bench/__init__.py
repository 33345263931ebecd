"""Every benchmark of the project, each run as ``python -m pipeline.bench.<name>``: the kernels (SPEC section 8,
stage arm-bench: ``kernels`` times the products, ``kernels_report`` writes the markdown and the chart; this module
holds the stage's parameters and the paper's shapes), tokens/s (``generate``, ``vision``, ``serve``), a real
model beside llama.cpp (``real_model``, ``perplexity``), the formats and post-training methods (``bench_formats``,
``real_weights``, ``ptq_ablation``, ``quant_sensitivity``, ``sensitivity``), QAT throughput (``qat_throughput``) and
the 11B-shaped skeleton on CPU and GPU (``skeleton_11b``, ``gpu_check``).
"""

from __future__ import annotations

from dataclasses import dataclass

PAPER_SHAPES = [  # SPEC section 8: operation, (m, k, n), Pixel 8a GMAC/s (bf16, INT8, S3D8), 5 cores
    ("text.attn.[q,o] generate", (1, 4096, 4096), (14.2, 29.2, 31.2)),
    ("text.attn.[k,v] generate", (1, 4096, 1024), (12.2, 29.2, 30.2)),
    ("text.mlp.up generate", (1, 4096, 14336), (13.6, 26.5, 33.8)),
    ("text.mlp.down generate", (1, 14336, 4096), (13.2, 23.7, 34.3)),
    ("text.predict generate", (1, 4096, 128256), (11.8, 28.1, 31.7)),
    ("text.attn.[q,o] prefill", (128, 4096, 4096), (88.3, 205.5, 202.1)),
    ("text.attn.[k,v] prefill", (128, 4096, 1024), (79.9, 204.6, 213.8)),
    ("text.mlp.up prefill", (128, 4096, 14336), (76.3, 201.1, 197.7)),
    ("text.mlp.down prefill", (128, 14336, 4096), (107.8, 214.3, 203.6)),
    ("vision.attn.[q,k,v,o]", (1601, 1280, 1280), (122.9, 212.3, 229.9)),
    ("vision.mlp.up", (1601, 1280, 5120), (116.5, 206.1, 211.8)),
    ("vision.mlp.down", (1601, 5120, 1280), (118.6, 230.0, 238.6)),
]


@dataclass
class BenchParams:
    """``bench:`` in params.yaml."""
    shapes: list[str]
    threads: list[int]
    repeats: int         # timed rounds per shape (median), fewer when a round is slow
    budget_s: float      # time per shape and thread count beyond which rounds stop (at least 3)
    rotate_mb: int       # weight copies per format total at least this: weights come from DRAM
    hot: bool            # one weight copy: served from cache when it fits
    variant: str | None  # force a library variant (default: the fastest, or $S3D8_VARIANT)
    seed: int
