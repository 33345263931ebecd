"""The real-weights benchmark's casts (``pipeline.bench.real_weights``) are the pipeline's own: each algorithm's
decoded weight equals ``ptq.direct_cast``'s bit for bit, for every comparison format, through the formats' hooks."""

import torch

from pipeline import formats
from pipeline.bench import real_weights
from pipeline.cast import ptq


def test_each_algorithm_decodes_as_the_pipeline_casts():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 64, generator=gen)
    x = torch.randn(256, 64, generator=gen) * torch.linspace(0.2, 3.0, 64)
    h = x.T @ x
    for name in formats.QUANTISED:
        fitted = None
        for algorithm in real_weights.ALGORITHMS:
            q, state = real_weights.cast(name, w, algorithm, h, seed=0, fitted=fitted)
            fitted = state if algorithm == "absmax" else fitted
            kwargs = {"importance": h.diagonal()} if algorithm == "search_w" else (
                {"hessian": h} if algorithm == "gptq" else {})
            want = ptq.direct_cast(formats.get(name), w, algorithm=algorithm.removesuffix("_w"), seed=0, **kwargs)
            assert torch.equal(q, want), (name, algorithm)
    ref = real_weights.gaussian_reference(seed=0)
    assert 0 < ref["s3d8_search"] <= ref["s3d8_absmax"] < 0.1
