"""Speed of the Python S3D8 reference: nearest-centroid encoding and centroid fitting, one core.

Target (issue 2): encoding >= 20 million weights per second on one core, with bounded temporaries;
fitting (2^22-vector subsample) in seconds per matrix. Usage:

    .venv/bin/python -m pipeline.bench.bench_formats [--shape 4096x14336] [--out reports/format_bench.json]
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time

import torch

from pipeline.formats import s3d8
from pipeline.files.atomic import write_json


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.bench_formats", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4096x14336", help="d_out x d_in of the benchmark matrix")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    d_out, d_in = (int(v) for v in args.shape.lower().split("x"))
    weight = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(0)) * 0.02

    t0 = time.perf_counter()
    table = s3d8.fit_centroids(weight, seed=0)
    fit_s = time.perf_counter() - t0

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        s3d8.encode(weight, table)
        times.append(time.perf_counter() - t0)
    encode_s = statistics.median(times)
    peak_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024

    result = {
        "shape": [d_out, d_in],
        "threads": 1,
        "fit_seconds": round(fit_s, 3),
        "encode_seconds_median": round(encode_s, 4),
        "encode_mweights_per_s": round(weight.numel() / encode_s / 1e6, 2),
        "encode_peak_rss_growth_mb": round(peak_growth_mb, 1),
        "target_mweights_per_s": 20,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    for k, v in result.items():
        print(f"{k:>28}: {v}")
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
