"""The benchmark harness: time this library's S3D8, INT8 and bf16 products against torch's own paths.

For every shape (m x k x n) and thread count: this library's products (float32 in, float32 out,
activations quantised per token inside) and the torch paths a user would pick instead (fp32 / bf16
``F.linear``, torch's dynamic int8 ``Linear`` (fbgemm), and the raw int8 GEMM ``torch._int_mm``, given
pre-quantised activations and returning int32). Weights rotate through copies totalling at least
``rotate_mb`` so that they come from memory (``hot``: one copy). A plain read of the INT8 copies is the
memory-bandwidth yardstick; for large m, S3D8 is also timed per path and as a decode alone.

Generate shapes (m <= ``native.FUSED_MAX_M``) are measured as a decode runs them: one implementation
at a time calls the product on weight copy 0, 1, 2, ... back to back, and the sweep's time divided by
the copies is one sample (the same access pattern as ``native/s3d8_bench``). Larger shapes time one
call per implementation per round. Either way the implementations take turns in a new order every
round, so machine noise hits them alike, and the median over rounds is recorded.
"""

from __future__ import annotations

import math
import os
import platform
import random
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from pipeline import native

from pipeline.packed import layout
from pipeline.bench import PAPER_SHAPES, BenchParams
from pipeline.formats import BF16_BASELINE, INT8_BASELINE, SUBJECT

OP_NAMES = {shape: (op, pixel) for op, shape, pixel in PAPER_SHAPES}
INT_MM = "torch._int_mm (int8 x given, int32 out)"   # the raw GEMM, without quantise / dequantise
MAX_COPIES = 4096  # tiny weights: enough copies to leave L1/L2, without minutes of set-up


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r}: expected MxKxN, e.g. 1x4096x14336") from None
    if min(m, k, n) < 1:
        raise ValueError(f"shape {text!r}: sizes must be positive")
    return m, k, n


def check_params(p: BenchParams) -> list[tuple[int, int, int]]:
    """Validate ``p`` (errors name the parameter); returns the parsed shapes."""
    if not p.shapes:
        raise ValueError("bench.shapes: expected at least one MxKxN shape")
    shapes = [parse_shape(s) for s in p.shapes]
    if not p.threads or min(p.threads) < 1:
        raise ValueError(f"bench.threads: expected positive thread counts, got {p.threads}")
    for name in ("repeats", "rotate_mb"):
        if getattr(p, name) < 1:
            raise ValueError(f"bench.{name}: expected a positive integer, got {getattr(p, name)}")
    if p.budget_s <= 0:
        raise ValueError(f"bench.budget_s: expected a positive number of seconds, got {p.budget_s}")
    if p.variant is not None and p.variant not in native.available_variants():
        raise ValueError(f"bench.variant: {p.variant!r} is not available here; "
                         f"available: {', '.join(native.available_variants())}")
    return shapes


@dataclass
class Impl:
    """One timed implementation: ``call(i)`` runs it on weight copy ``i``."""
    key: str                  # stable name in reports/bench.json
    fmt: str
    impl: str                 # the words in reports/bench.md
    variant: str
    weight_bytes: int
    call: Callable[[int], object]
    copies: int
    product: bool = True      # False for the memory read and the decode alone (no GMAC/s)
    times: list[float] = field(default_factory=list)
    next_copy: int = 0


def n_copies(nbytes: int, p: BenchParams) -> int:
    return 1 if p.hot else min(MAX_COPIES, max(1, math.ceil(p.rotate_mb * 2 ** 20 / nbytes)))


def make_impls(m: int, k: int, n: int, threads: int, p: BenchParams, gen: torch.Generator) -> list[Impl]:
    lib_variant = p.variant or native.variant()
    torch_variant = f"torch-{torch.backends.cpu.get_cpu_capability()}"
    rows, cols = layout.packed_shape(n, k)
    x = torch.randn(m, k, generator=gen)
    x_bf16 = x.to(torch.bfloat16)
    xq, _ = native.quantize_activations(x)
    scale = (torch.rand(n, 1, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    table = torch.randint(0, 128, layout.TABLE_SHAPE, dtype=torch.int8, generator=gen)
    v = p.variant
    fused = m <= native.FUSED_MAX_M

    # Copies of one random tensor per format (values do not change the speed); implementations of a
    # format share them, and consecutive calls of one implementation always use different copies.
    pool_bytes = {SUBJECT: rows * cols, INT8_BASELINE: n * k, BF16_BASELINE: 2 * n * k, "fp32": 4 * n * k}
    makers = {SUBJECT: lambda: torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen),
              INT8_BASELINE: lambda: torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
              BF16_BASELINE: lambda: torch.randn(n, k, generator=gen).to(torch.bfloat16),
              "fp32": lambda: torch.randn(n, k, generator=gen)}
    pools: dict[str, list] = {}
    for name, make in makers.items():
        first = make()
        pools[name] = [first] + [first.clone() for _ in range(n_copies(pool_bytes[name], p) - 1)]
    w_scales, zeros = scale.float().flatten(), torch.zeros(n, dtype=torch.long)
    layers = []
    for w in pools[INT8_BASELINE]:
        with warnings.catch_warnings():  # torch deprecates the quantized tensors it still uses here
            warnings.simplefilter("ignore", UserWarning)
            layer = torch.ao.nn.quantized.dynamic.Linear(k, n, dtype=torch.qint8)
            layer.set_weight_bias(torch._make_per_channel_quantized_tensor(w, w_scales, zeros, 0), None)
        layers.append(layer)
    pools["fbgemm"], pool_bytes["fbgemm"] = layers, n * k

    impls: list[Impl] = []

    def add(key, fmt, impl, variant, pool, call, product=True):
        data = pools[pool]
        impls.append(Impl(key, fmt, impl, variant, pool_bytes[pool], lambda i: call(data[i % len(data)]),
                          len(data), product))

    add(SUBJECT, SUBJECT, "library", lib_variant, SUBJECT,
        lambda w: native.s3d8_matmul(x, w, scale, table, (n, k), variant=v, threads=threads))
    if not fused:
        for path in native.PATHS:
            add(f"{SUBJECT}_{path}", SUBJECT, f"library path={path}", lib_variant, SUBJECT,
                lambda w, path=path: native.s3d8_matmul(x, w, scale, table, (n, k), variant=v,
                                                        threads=threads, path=path))
        decoded = torch.empty(n, k, dtype=torch.int8)
        add(f"{SUBJECT}_decode", SUBJECT, "library decode only", lib_variant, SUBJECT,
            lambda w: native.s3d8_decode_int8(w, table, (n, k), variant=v, threads=threads, out=decoded),
            product=False)
    add(INT8_BASELINE, INT8_BASELINE, "library", lib_variant, INT8_BASELINE,
        lambda w: native.int8_matmul(x, w, scale, variant=v, threads=threads))
    if not fused:
        for path in ("fused", "torch"):
            add(f"{INT8_BASELINE}_{path}", INT8_BASELINE, f"library path={path}", lib_variant, INT8_BASELINE,
                lambda w, path=path: native.int8_matmul(x, w, scale, variant=v, threads=threads, path=path))
    add(f"{INT8_BASELINE}_int_mm", INT8_BASELINE, INT_MM, torch_variant, INT8_BASELINE,
        lambda w: torch._int_mm(xq, w.t()))
    add(f"{INT8_BASELINE}_fbgemm", INT8_BASELINE, "torch dynamic int8 Linear (fbgemm)", torch_variant, "fbgemm",
        lambda layer: layer(x))
    if m == 1 and threads == 1:  # the probe reads on one thread
        add("read", "read", "memory read (bandwidth probe)", lib_variant, INT8_BASELINE,
            lambda w: native.read_bandwidth_probe(w.view(torch.uint8)), product=False)
    add(f"{BF16_BASELINE}_torch", BF16_BASELINE, "torch F.linear", torch_variant, BF16_BASELINE,
        lambda w: F.linear(x_bf16, w))
    if fused:
        add(BF16_BASELINE, BF16_BASELINE, "library", lib_variant, BF16_BASELINE,
            lambda w: native.bf16_matmul(x, w, variant=v, threads=threads))
    add("fp32_torch", "fp32", "torch F.linear", torch_variant, "fp32", lambda w: F.linear(x, w))
    return impls


def check_consistency(m: int, k: int, n: int, p: BenchParams, gen: torch.Generator) -> None:
    """The S3D8 product equals the INT8 product of the decoded weights, on every path."""
    rows, cols = -(-n // 3), -(-k // 16) * 16
    w = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)
    table = torch.randint(0, 128, (32, 3), dtype=torch.int8, generator=gen)
    scale = torch.full((n, 1), 0.01, dtype=torch.bfloat16)
    x = torch.randn(min(m, 20), k, generator=gen)
    ref = native.int8_matmul(x, native.s3d8_decode_int8(w, table, (n, k), variant=p.variant), scale,
                             variant=p.variant, path="torch")
    for path in native.PATHS:
        if not torch.equal(native.s3d8_matmul(x, w, scale, table, (n, k), variant=p.variant, path=path), ref):
            raise ValueError(f"shape {m}x{k}x{n}: S3D8 (path {path}) and INT8 products disagree "
                             f"(variant {p.variant or native.variant()})")


def sample(impl: Impl, sweep: bool) -> float:
    """Seconds per call: a back-to-back sweep over every copy (as a decode streams its layers), or one call."""
    if sweep:
        t0 = time.perf_counter()
        for i in range(impl.copies):
            impl.call(i)
        return (time.perf_counter() - t0) / impl.copies
    impl.next_copy += 1
    t0 = time.perf_counter()
    impl.call(impl.next_copy)
    return time.perf_counter() - t0


def measure(m: int, k: int, n: int, threads: int, p: BenchParams) -> list[dict]:
    """Time every implementation on one shape; one record per implementation."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(p.seed)
    check_consistency(m, k, n, p, gen)
    impls = make_impls(m, k, n, threads, p, gen)
    sweep = m <= native.FUSED_MAX_M
    started = time.perf_counter()
    rounds = 0
    while rounds < p.repeats + 1:       # round 0 warms up and is not recorded
        order = list(range(len(impls)))  # a new order every round: no implementation always
        random.Random(p.seed * 1000 + rounds).shuffle(order)  # follows the same one (caches, pages)
        for j in order:
            dt = sample(impls[j], sweep)
            if rounds:
                impls[j].times.append(dt)
        rounds += 1
        if rounds > 3 and time.perf_counter() - started > p.budget_s:
            break
    op, _ = OP_NAMES.get((m, k, n), ("custom", None))
    records = []
    for impl in impls:
        t = statistics.median(impl.times)
        records.append({
            "op": op, "m": m, "k": k, "n": n, "key": impl.key, "format": impl.fmt, "impl": impl.impl,
            "variant": impl.variant, "threads": threads, "mode": "hot" if p.hot else "cold",
            "timing": "sweep" if sweep else "call", "copies": impl.copies, "rounds": len(impl.times),
            "ms": round(t * 1e3, 4), "gmacs": round(m * k * n / t / 1e9, 3) if impl.product else None,
            "weight_gbps": round(impl.weight_bytes / t / 1e9, 3),
        })
    return records


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
            "next_block_prefetch": native.next_block_prefetch(),
            "torch": torch.__version__, "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "load_average_start": round(os.getloadavg()[0], 2)}


def run(p: BenchParams, log: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    """Measure every shape and thread count of ``p``: (records, machine info with load averages)."""
    shapes = check_params(p)
    machine = machine_info(p)
    records = []
    for t in p.threads:
        for m, k, n in shapes:
            started = time.perf_counter()
            rs = measure(m, k, n, t, p)
            records += rs
            lib = {r["format"]: r["gmacs"] for r in rs if r["impl"] == "library"}
            log(f"arm-bench ({m}, {k}, {n}) {t}T: S3D8 {lib.get(SUBJECT)}, INT8 {lib.get(INT8_BASELINE)} GMAC/s, "
                f"variant {machine['variant']} ({time.perf_counter() - started:.0f} s)")
    machine["load_average_end"] = round(os.getloadavg()[0], 2)
    return records, machine


# ---- the results ---------------------------------------------------------------------------------

def rec(records, m, k, n, threads, key):
    """The record of one implementation (by key), or None."""
    return next((r for r in records if (r["m"], r["k"], r["n"], r["threads"], r["key"]) == (m, k, n, threads, key)), None)


def best(records, m, k, n, threads, fmt, linear=False):
    """The fastest product of a format; ``linear``: only float-in/float-out ones (not ``torch._int_mm``)."""
    rs = [r for r in records if (r["m"], r["k"], r["n"], r["threads"], r["format"]) == (m, k, n, threads, fmt)
          and r["gmacs"] is not None and not (linear and r["key"] == f"{INT8_BASELINE}_int_mm")]
    return max(rs, key=lambda r: r["gmacs"]) if rs else None


def summarise(records: list[dict]) -> dict:
    """The issue's targets, computed from the measurements (absent where a shape was not run)."""
    out: dict = {}
    for t in sorted({r["threads"] for r in records}):
        s3d8, int8 = rec(records, 1, 4096, 14336, t, SUBJECT), rec(records, 1, 4096, 14336, t, INT8_BASELINE)
        read = rec(records, 1, 4096, 14336, t, "read")
        if s3d8:
            out[f"m1_s3d8_gmacs_{t}t"] = s3d8["gmacs"]
        if s3d8 and int8:
            out[f"m1_s3d8_over_int8_{t}t"] = round(s3d8["gmacs"] / int8["gmacs"], 3)
        if int8 and read:
            out[f"m1_int8_bandwidth_fraction_{t}t"] = round(int8["weight_gbps"] / read["weight_gbps"], 3)
            out[f"read_gbps_{t}t"] = read["weight_gbps"]
        for m, k, n in sorted({(r["m"], r["k"], r["n"]) for r in records if r["m"] > native.FUSED_MAX_M}):
            lib, linear = rec(records, m, k, n, t, SUBJECT), best(records, m, k, n, t, INT8_BASELINE, linear=True)
            raw = rec(records, m, k, n, t, f"{INT8_BASELINE}_int_mm")
            if lib and linear:
                out[f"m{m}_k{k}_n{n}_s3d8_over_best_int8_{t}t"] = round(lib["gmacs"] / linear["gmacs"], 3)
            if lib and raw:
                out[f"m{m}_k{k}_n{n}_s3d8_over_raw_int_mm_{t}t"] = round(lib["gmacs"] / raw["gmacs"], 3)
    return out


def metrics(records: list[dict]) -> dict:
    """``reports/bench.json``: numbers only, under keys that depend on the shapes and threads alone.

    ``summary``: the issue's targets. ``gmacs.<MxKxN>.<T>t.<impl>``: every product. ``s3d8_over_int8``:
    S3D8 over this library's INT8 (``library``) and over the best float-in/float-out INT8 (``best``).
    ``bandwidth_gbps``: weight bytes per second of the read probe, the decode alone, and the generate
    shapes' library products.
    """
    gmacs: dict = {}
    ratios: dict = {}
    bandwidth: dict = {}
    for r in records:
        shape, t = f"{r['m']}x{r['k']}x{r['n']}", f"{r['threads']}t"
        if r["gmacs"] is not None:
            gmacs.setdefault(shape, {}).setdefault(t, {})[r["key"]] = r["gmacs"]
        if r["gmacs"] is None or (r["m"] <= native.FUSED_MAX_M and r["key"] in (SUBJECT, INT8_BASELINE)):
            bandwidth.setdefault(shape, {}).setdefault(t, {})[r["key"]] = r["weight_gbps"]
    for shape, by_t in gmacs.items():
        for t, g in by_t.items():
            m, k, n = parse_shape(shape)
            linear = best(records, m, k, n, int(t[:-1]), INT8_BASELINE, linear=True)
            if SUBJECT in g and INT8_BASELINE in g:
                ratios.setdefault(shape, {}).setdefault(t, {})["library"] = round(g[SUBJECT] / g[INT8_BASELINE], 3)
            if SUBJECT in g and linear:
                ratios.setdefault(shape, {}).setdefault(t, {})["best"] = round(g[SUBJECT] / linear["gmacs"], 3)
    return {"summary": summarise(records), "gmacs": gmacs, f"{SUBJECT}_over_{INT8_BASELINE}": ratios,
            "bandwidth_gbps": bandwidth}
