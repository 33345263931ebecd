"""DVC stage arm-bench: the paper's kernel table (SPEC section 8) measured on this machine.

    python stages/arm_bench.py                                   # params.yaml `bench`
    python stages/arm_bench.py --shapes 1x4096x14336 --threads 1,2 --out /tmp/bench.json

For every shape (m x k x n) and thread count it times, interleaved round by round so that machine
noise hits every implementation alike: this library's S3D8, INT8 and bf16 products (float32 in,
float32 out, activations quantised per token inside), and the torch paths a user would pick instead
(fp32 / bf16 ``F.linear``, torch's dynamic int8 ``Linear`` (fbgemm), and the raw int8 GEMM
``torch._int_mm``, which is given pre-quantised activations and returns int32). Weights rotate
through copies totalling at least ``rotate_mb`` so they stream from memory, as in token generation
(``hot``: one copy). A plain read of the INT8 weight copies gives the memory-bandwidth yardstick.
For large m, S3D8 is also timed per path and as a decode alone, to show where the time goes.

Writes ``reports/bench.json`` (one record per measurement), ``reports/bench.md`` (the paper's table
with its Pixel 8a figures beside ours, the targets, the breakdown) and ``reports/bench.png``.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a shared machine (more
# runnable threads than cores) a spinning thread holds a core that a worker needs, and every
# parallel region can stall for a scheduler time slice; on a quiet machine it costs a few
# microseconds per call. Set OMP_WAIT_POLICY=active in the environment to measure the other way.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import math
import platform
import random
import re
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline import native, params
from pipeline.io import atomic_path, write_json, write_text
from pipeline.stage import console, stage_errors, versions

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
OP_NAMES = {shape: (op, pixel) for op, shape, pixel in PAPER_SHAPES}
INT_MM = "torch._int_mm (int8 x given, int32 out)"   # the raw GEMM, without quantise / dequantise


@dataclass
class BenchParams:
    shapes: list[str] = field(default_factory=lambda: ["x".join(map(str, s)) for _, s, _ in PAPER_SHAPES])
    threads: list[int] = field(default_factory=lambda: [1, 2])
    repeats: int = 15          # timed rounds per shape (median), fewer when a round is slow
    budget_s: float = 6.0      # time per shape and thread count beyond which rounds stop (at least 3)
    rotate_mb: int = 512       # weight copies per implementation total at least this
    hot: bool = False          # one weight copy: served from cache when it fits
    variant: str | None = None  # force a library variant (default: the fastest, or $S3D8_VARIANT)
    seed: int = 0


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r}: expected MxKxN, e.g. 1x4096x14336") from None
    if min(m, k, n) < 1:
        raise ValueError(f"shape {text!r}: sizes must be positive")
    return m, k, n


@dataclass
class Impl:
    """One timed implementation: ``call(i)`` runs it on weight copy ``i``."""
    fmt: str
    impl: str
    variant: str
    weight_bytes: int
    call: object
    copies: int
    product: bool = True      # False for the memory read and the decode alone (no GMAC/s)
    times: list[float] = field(default_factory=list)


MAX_COPIES = 4096  # tiny weights: enough copies to leave L1/L2, without minutes of set-up


def n_copies(nbytes: int, p: BenchParams) -> int:
    return 1 if p.hot else min(MAX_COPIES, max(1, math.ceil(p.rotate_mb * 2 ** 20 / nbytes)))


def make_impls(m: int, k: int, n: int, threads: int, p: BenchParams, gen: torch.Generator) -> list[Impl]:
    lib_variant = p.variant or native.variant()
    torch_variant = f"torch-{torch.backends.cpu.get_cpu_capability()}"
    rows, cols = -(-n // 3), -(-k // 16) * 16
    x = torch.randn(m, k, generator=gen)
    x_bf16 = x.to(torch.bfloat16)
    xq, _ = native.quantize_activations(x)
    scale = (torch.rand(n, 1, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    table = torch.randint(0, 128, (32, 3), dtype=torch.int8, generator=gen)
    pools: dict[str, list] = {}
    impls: list[Impl] = []

    def add(fmt, impl, variant, pool, call, product=True):
        data = pools[pool]
        impls.append(Impl(fmt, impl, variant, pool_bytes[pool], lambda i: call(data[i % len(data)]),
                          len(data), product))

    # Copies of one random tensor per format (values do not change the speed); implementations of a
    # format share them, and consecutive calls always use different copies.
    pool_bytes = {"s3d8": rows * cols, "int8": n * k, "bf16": 2 * n * k, "fp32": 4 * n * k}
    makers = {"s3d8": lambda: torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen),
              "int8": lambda: torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
              "bf16": lambda: torch.randn(n, k, generator=gen).to(torch.bfloat16),
              "fp32": lambda: torch.randn(n, k, generator=gen)}
    for name, make in makers.items():
        first = make()
        pools[name] = [first] + [first.clone() for _ in range(n_copies(pool_bytes[name], p) - 1)]
    w_scales, zeros = scale.float().flatten(), torch.zeros(n, dtype=torch.long)
    layers = []
    for w in pools["int8"]:
        with warnings.catch_warnings():  # torch deprecates the quantized tensors it still uses here
            warnings.simplefilter("ignore", UserWarning)
            layer = torch.ao.nn.quantized.dynamic.Linear(k, n, dtype=torch.qint8)
            layer.set_weight_bias(torch._make_per_channel_quantized_tensor(w, w_scales, zeros, 0), None)
        layers.append(layer)
    pools["fbgemm"], pool_bytes["fbgemm"] = layers, n * k

    add("s3d8", "library", lib_variant, "s3d8",
        lambda w: native.s3d8_matmul(x, w, scale, table, (n, k), variant=p.variant, threads=threads))
    if m > native.FUSED_MAX_M:
        for path in native.PATHS:
            add("s3d8", f"library path={path}", lib_variant, "s3d8",
                lambda w, path=path: native.s3d8_matmul(x, w, scale, table, (n, k), variant=p.variant,
                                                        threads=threads, path=path))
        decoded = torch.empty(n, k, dtype=torch.int8)
        add("s3d8", "library decode only", lib_variant, "s3d8",
            lambda w: native.s3d8_decode_int8(w, table, (n, k), variant=p.variant, threads=threads,
                                              out=decoded), product=False)
    add("int8", "library", lib_variant, "int8",
        lambda w: native.int8_matmul(x, w, scale, variant=p.variant, threads=threads))
    if m > native.FUSED_MAX_M:
        for path in ("fused", "torch"):
            add("int8", f"library path={path}", lib_variant, "int8",
                lambda w, path=path: native.int8_matmul(x, w, scale, variant=p.variant, threads=threads,
                                                        path=path))
    add("int8", INT_MM, torch_variant, "int8", lambda w: torch._int_mm(xq, w.t()))
    add("int8", "torch dynamic int8 Linear (fbgemm)", torch_variant, "fbgemm", lambda layer: layer(x))
    if m == 1 and threads == 1:  # the probe reads on one thread
        add("read", "memory read (bandwidth probe)", lib_variant, "int8",
            lambda w: native.read_bandwidth_probe(w.view(torch.uint8)), product=False)
    add("bf16", "torch F.linear", torch_variant, "bf16", lambda w: F.linear(x_bf16, w))
    if m <= native.FUSED_MAX_M:
        add("bf16", "library", lib_variant, "bf16",
            lambda w: native.bf16_matmul(x, w, variant=p.variant, threads=threads))
    add("fp32", "torch F.linear", torch_variant, "fp32", lambda w: F.linear(x, w))
    return impls


def check_consistency(m: int, k: int, n: int, p: BenchParams, gen: torch.Generator) -> bool:
    """The S3D8 product equals the INT8 product of the decoded weights, on every path."""
    rows, cols = -(-n // 3), -(-k // 16) * 16
    w = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)
    table = torch.randint(0, 128, (32, 3), dtype=torch.int8, generator=gen)
    scale = torch.full((n, 1), 0.01, dtype=torch.bfloat16)
    x = torch.randn(min(m, 20), k, generator=gen)
    ref = native.int8_matmul(x, native.s3d8_decode_int8(w, table, (n, k), variant=p.variant), scale,
                             variant=p.variant, path="torch")
    return all(torch.equal(native.s3d8_matmul(x, w, scale, table, (n, k), variant=p.variant, path=path), ref)
               for path in native.PATHS)


def measure(m: int, k: int, n: int, threads: int, p: BenchParams) -> list[dict]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(p.seed)
    ok = check_consistency(m, k, n, p, gen)
    if not ok:
        raise ValueError(f"shape {m}x{k}x{n}: S3D8 and INT8 products disagree (variant {p.variant or native.variant()})")
    impls = make_impls(m, k, n, threads, p, gen)
    started = time.perf_counter()
    rounds = 0
    calls = 0
    while rounds < p.repeats + 1:       # round 0 warms up and is not recorded
        order = list(range(len(impls)))  # a new order every round: no implementation always
        random.Random(p.seed * 1000 + rounds).shuffle(order)  # follows the same one (caches, pages)
        for j in order:
            impl = impls[j]
            calls += 1
            t0 = time.perf_counter()
            impl.call(calls)
            dt = time.perf_counter() - t0
            if rounds:
                impl.times.append(dt)
        rounds += 1
        if rounds > 3 and time.perf_counter() - started > p.budget_s:
            break
    op, _ = OP_NAMES.get((m, k, n), ("custom", None))
    records = []
    for impl in impls:
        t = statistics.median(impl.times)
        records.append({
            "op": op, "m": m, "k": k, "n": n, "format": impl.fmt, "impl": impl.impl,
            "variant": impl.variant, "threads": threads, "mode": "hot" if p.hot else "cold",
            "copies": impl.copies, "repeats": len(impl.times), "ms": round(t * 1e3, 4),
            "gmacs": round(m * k * n / t / 1e9, 3) if impl.product else None,
            "weight_gbps": round(impl.weight_bytes / t / 1e9, 3), "check": "ok",
        })
    return records


# ---- report ------------------------------------------------------------------------------------

def best(records, m, k, n, threads, fmt, prefix=None):
    """The fastest record of a format (optionally of implementations whose name starts with prefix)."""
    rs = [r for r in records if (r["m"], r["k"], r["n"], r["threads"], r["format"]) == (m, k, n, threads, fmt)
          and r["gmacs"] is not None and (prefix is None or r["impl"].startswith(prefix))]
    return max(rs, key=lambda r: r["gmacs"]) if rs else None


def rec(records, m, k, n, threads, fmt, impl):
    """The record of one implementation, or None."""
    key = (m, k, n, threads, fmt, impl)
    return next((r for r in records if (r["m"], r["k"], r["n"], r["threads"], r["format"], r["impl"]) == key), None)


def summarise(records: list[dict]) -> dict:
    """The issue's targets, computed from the measurements (absent where a shape was not run)."""
    out: dict = {}
    for t in sorted({r["threads"] for r in records}):
        s3d8 = rec(records, 1, 4096, 14336, t, "s3d8", "library")
        int8 = rec(records, 1, 4096, 14336, t, "int8", "library")
        read = rec(records, 1, 4096, 14336, t, "read", "memory read (bandwidth probe)")
        if s3d8:
            out[f"m1_s3d8_gmacs_{t}t"] = s3d8["gmacs"]
        if s3d8 and int8:
            out[f"m1_s3d8_over_int8_{t}t"] = round(s3d8["gmacs"] / int8["gmacs"], 3)
        if int8 and read:
            out[f"m1_int8_bandwidth_fraction_{t}t"] = round(int8["weight_gbps"] / read["weight_gbps"], 3)
            out[f"read_gbps_{t}t"] = read["weight_gbps"]
        for m, k, n in sorted({(r["m"], r["k"], r["n"]) for r in records if r["m"] > native.FUSED_MAX_M}):
            lib = rec(records, m, k, n, t, "s3d8", "library")
            linear = best_linear_int8(records, m, k, n, t)
            raw = rec(records, m, k, n, t, "int8", INT_MM)
            if lib and linear:
                out[f"m{m}_k{k}_n{n}_s3d8_over_best_int8_{t}t"] = round(lib["gmacs"] / linear["gmacs"], 3)
            if lib and raw:
                out[f"m{m}_k{k}_n{n}_s3d8_over_raw_int_mm_{t}t"] = round(lib["gmacs"] / raw["gmacs"], 3)
    return out


def best_linear_int8(records, m, k, n, threads):
    """The fastest INT8 product that, like S3D8's, takes float32 activations and returns float32."""
    rs = [r for r in records if (r["m"], r["k"], r["n"], r["threads"], r["format"]) == (m, k, n, threads, "int8")
          and r["impl"] != INT_MM and r["gmacs"] is not None]
    return max(rs, key=lambda r: r["gmacs"]) if rs else None


TARGETS = [  # (summary key, threshold, text)
    ("m1_s3d8_gmacs_1t", 30.0, "m=1 (1,4096,14336) cold, 1 thread: S3D8 >= 30 GMAC/s"),
    ("m1_s3d8_over_int8_1t", 2.0, "m=1, 1 thread: S3D8 >= 2x this library's INT8 GEMV"),
    ("m1_s3d8_gmacs_2t", 50.0, "m=1, 2 threads: S3D8 >= 50 GMAC/s"),
    ("m1_int8_bandwidth_fraction_1t", 0.9, "INT8 GEMV >= 90% of single-thread read bandwidth"),
]


def fmt_num(v) -> str:
    return "–" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))


def markdown(records: list[dict], summary: dict, machine: dict, p: BenchParams) -> str:
    threads = sorted({r["threads"] for r in records})
    shapes = sorted({(r["m"], r["k"], r["n"]) for r in records}, key=lambda s: (s[0], s[1], s[2]))
    order = {s: i for i, (_, s, _) in enumerate(PAPER_SHAPES)}
    shapes.sort(key=lambda s: order.get(s, 99))
    lines = ["# Kernel benchmarks (arm-bench)", "",
             f"Measured by `stages/arm_bench.py` on {machine['cpu']} ({machine['arch']}, {machine['cores']} cores), "
             f"library variant **{machine['variant']}** (available: {', '.join(machine['variants'])}), "
             f"torch {machine['torch']} ({machine['torch_capability']}), OMP_WAIT_POLICY={machine.get('omp_wait_policy') or 'unset'}, "
             f"load average {machine.get('load_average_start')} at the start, {machine.get('load_average_end')} at the end. Weights {'hot (one copy)' if p.hot else f'cold: rotating over at least {p.rotate_mb} MB of copies'}; "
             "median of interleaved rounds. GMAC/s = m·k·n / time. Products are float32 in, float32 out, "
             "activations quantised per token inside (except `torch._int_mm`, given int8 activations, int32 out). "
             "The Pixel 8a columns are the paper's published figures (5 cores), for comparison only.", ""]
    for t in threads:
        lines += [f"## {t} thread{'s' if t > 1 else ''}", "",
                  "| operation | (m, k, n) | Pixel 8a bf16 | Pixel 8a INT8 | Pixel 8a S3D8 | bf16 (best) | INT8 (best) | INT8 (library) | S3D8 (library) | S3D8 / best INT8 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in shapes:
            op, pixel = OP_NAMES.get(s, ("custom", (None, None, None)))
            b16, i8 = best(records, *s, t, "bf16"), best(records, *s, t, "int8")
            li8, s3 = rec(records, *s, t, "int8", "library"), rec(records, *s, t, "s3d8", "library")
            ratio = s3["gmacs"] / i8["gmacs"] if s3 and i8 else None
            lines.append(f"| {op} | {s} | {fmt_num(pixel[0])} | {fmt_num(pixel[1])} | {fmt_num(pixel[2])} | "
                         f"{fmt_num(b16 and b16['gmacs'])} | {fmt_num(i8 and i8['gmacs'])} | {fmt_num(li8 and li8['gmacs'])} | "
                         f"**{fmt_num(s3 and s3['gmacs'])}** | {fmt_num(ratio and round(ratio, 2))} |")
        lines.append("")
    lines += ["## Targets (issue 3)", "", "| target | measured | met |", "| --- | --- | --- |"]
    for key, threshold, text in TARGETS:
        v = summary.get(key)
        lines.append(f"| {text} | {fmt_num(v) if v is None or v >= 10 else f'{v:.2f}'} | "
                     f"{'–' if v is None else ('yes' if v >= threshold else '**no**')} |")
    for key, v in sorted(summary.items()):
        match = re.fullmatch(r"m(\d+)_k(\d+)_n(\d+)_s3d8_over_(best_int8|raw_int_mm)_(\d+)t", key)
        if match:
            m, k, n, t = (int(match.group(i)) for i in (1, 2, 3, 5))
            threshold = 0.9 if m >= 1601 else 0.75
            what = ("the best INT8 linear (float in, float out)" if "best_int8" in key
                    else "raw torch._int_mm (int8 in, int32 out; informative)")
            met = "yes" if v >= threshold else ("**no**" if "best_int8" in key else "no")
            lines.append(f"| ({m}, {k}, {n}), {t} thread(s): S3D8 >= {threshold}x {what} | {v:.2f} | {met} |")
    unmet = [key for key, threshold, _ in TARGETS if summary.get(key) is not None and summary[key] < threshold]
    unmet += [key for key, v in summary.items() if "_over_best_int8_" in key
              and v < (0.9 if key.startswith("m1601") else 0.75)]
    if unmet:
        lines += ["", "Why a target is missed (the usual causes on this machine):", ""]
        if any(key.endswith("_2t") for key in unmet):
            lines.append(f"- 2 threads: the load average was {machine.get('load_average_start')} at the start and "
                         f"{machine.get('load_average_end')} at the end on {machine['cores']} cores; when other jobs "
                         "hold the second core, 2 threads run at about 1-thread speed.")
        if any(key.startswith("m128_") for key in unmet):
            lines.append("- m = 128: fbgemm's dynamic int8 `Linear` packs its weights once, at load time, for its "
                         "own GEMM; S3D8 decodes every call and runs the library's simpler 4x4 VNNI kernel.")
        if any(key.startswith("m1601_") for key in unmet):
            lines.append("- m = 1601: S3D8 uses the same INT8 GEMM (`torch._int_mm`) plus the decode and the float "
                         "epilogue; timings vary by up to 2x between runs here.")
        if any(key.startswith("m1_") and not key.endswith("_2t") for key in unmet):
            lines.append("- m = 1: the machine's memory bandwidth varied during the run (see the probe row).")
    lines += ["", "## Where the time goes (large m, S3D8)", "",
              "`decode only` decodes the whole matrix to INT8 (cold); the paths are: `fused` (decode + VNNI dot "
              "products in one pass), `tiled` (decode a tile into cache, then the library's INT8 kernel), `torch` "
              "(decode a tile, then `torch._int_mm`).", "",
              "| (m, k, n) | threads | S3D8 library ms | fused ms | tiled ms | torch ms | decode only ms | INT8 library ms | torch._int_mm ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in shapes:
        if s[0] <= native.FUSED_MAX_M:
            continue
        for t in threads:
            def get(impl, fmt="s3d8"):
                r = rec(records, *s, t, fmt, impl)
                return r and r["ms"]
            lines.append(f"| {s} | {t} | {fmt_num(get('library'))} | {fmt_num(get('library path=fused'))} | "
                         f"{fmt_num(get('library path=tiled'))} | {fmt_num(get('library path=torch'))} | "
                         f"{fmt_num(get('library decode only'))} | {fmt_num(get('library', 'int8'))} | "
                         f"{fmt_num(get(INT_MM, 'int8'))} |")
    lines += ["", "## Every measurement", "", "| (m, k, n) | threads | format | implementation | variant | GMAC/s | weight GB/s | ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| ({r['m']}, {r['k']}, {r['n']}) | {r['threads']} | {r['format']} | {r['impl']} | {r['variant']} | "
                     f"{fmt_num(r['gmacs'])} | {fmt_num(r['weight_gbps'])} | {r['ms']:.3f} |")
    return "\n".join(lines) + "\n"


def chart(records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = min(r["threads"] for r in records)
    shapes = [s for _, s, _ in PAPER_SHAPES if any((r["m"], r["k"], r["n"]) == s for r in records)]
    shapes += sorted({(r["m"], r["k"], r["n"]) for r in records} - set(shapes))
    series = [("bf16 (best)", lambda s: best(records, *s, t, "bf16")),
              ("INT8 (best)", lambda s: best(records, *s, t, "int8")),
              ("S3D8 (library)", lambda s: rec(records, *s, t, "s3d8", "library"))]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(shapes) + 2), 4.5))
    width = 0.8 / len(series)
    for i, (label, get) in enumerate(series):
        vals = [(get(s) or {}).get("gmacs") or 0 for s in shapes]
        ax.bar([j + (i - 1) * width for j in range(len(shapes))], vals, width, label=label)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"{OP_NAMES.get(s, ('custom',))[0]}\n{s}" for s in shapes], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GMAC/s")
    ax.set_yscale("log")
    variant = next((r["variant"] for r in records if r["impl"] == "library"), "?")
    ax.set_title(f"Kernel throughput, {t} thread(s), library variant {variant}")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def machine_info(p: BenchParams) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "arch": platform.machine(), "cores": os.cpu_count(),
            "variant": p.variant or native.variant(), "variants": native.available_variants(),
            "torch": torch.__version__, "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "load_average_start": round(os.getloadavg()[0], 2)}


def run(p: BenchParams, out: Path) -> dict:
    shapes = [parse_shape(s) for s in p.shapes]
    if not p.threads or min(p.threads) < 1:
        raise ValueError(f"bench.threads: expected positive thread counts, got {p.threads}")
    if p.variant is not None:
        native._variant_index(p.variant)   # fails early, naming the variants available
    machine = machine_info(p)
    records = []
    for t in p.threads:
        for m, k, n in shapes:
            started = time.perf_counter()
            rs = measure(m, k, n, t, p)
            records += rs
            lib = {r["format"]: r["gmacs"] for r in rs if r["impl"] == "library"}
            console.print(f"arm-bench ({m}, {k}, {n}) {t}T: S3D8 {fmt_num(lib.get('s3d8'))}, INT8 {fmt_num(lib.get('int8'))} "
                          f"GMAC/s [{machine['variant']}] ({time.perf_counter() - started:.0f} s)")
    machine["load_average_end"] = round(os.getloadavg()[0], 2)
    summary = summarise(records)
    result = {"machine": machine, "params": asdict(p), "summary": summary, **versions(), "records": records}
    write_json(out, result)
    write_text(out.with_suffix(".md"), markdown(records, summary, machine, p))
    chart(records, out.with_suffix(".png"))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--shapes", help="comma-separated MxKxN, e.g. 1x4096x14336,128x4096x4096")
    parser.add_argument("--threads", help="comma-separated thread counts, e.g. 1,2")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--variant", help="force a library variant")
    parser.add_argument("--hot", action="store_true", help="one weight copy (cache-resident when it fits)")
    parser.add_argument("--out", default="reports/bench.json", help="JSON path; .md and .png are written beside it")
    args = parser.parse_args(argv)
    with stage_errors("arm-bench"):
        p = params.load(BenchParams, "bench", args.params) if Path(args.params).exists() else BenchParams()
        if args.shapes:
            p.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
        if args.threads:
            p.threads = [int(t) for t in args.threads.split(",")]
        if args.repeats:
            p.repeats = args.repeats
        if args.variant:
            p.variant = args.variant
        if args.hot:
            p.hot = True
        run(p, Path(args.out))


if __name__ == "__main__":
    main()
