"""The machine a benchmark ran on, for its report: the CPU's model name and the SIMD flags that decide which
kernels run (x86: AVX2, AVX-512 VBMI / VNNI / BF16, AMX; Arm: dotprod, i8mm, SVE), core counts, platform; and what
a benchmark's process holds (peak resident memory, huge-page-backed memory)."""

from __future__ import annotations

import os
import platform
import resource
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_vbmi", "avx512vbmi", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8",
         "amx_bf16", "asimddp", "i8mm", "sve")


def describe() -> dict:
    """``{"cpu", "flags", "cpus", "usable_cpus", "platform"}`` from ``/proc/cpuinfo`` (where there is one)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("", platform.machine(), platform.processor()):
                name = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": name, "flags": [f for f in FLAGS if f in flags], "cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "platform": platform.platform(), "s3d8_next_block_prefetch": _next_block_prefetch()}


def _next_block_prefetch() -> str | None:
    """``native.next_block_prefetch()`` (l1 / l2, what the S3D8 decode's speed depends on), None without a build."""
    try:
        from pipeline import native
    except ImportError:
        return None
    return native.next_block_prefetch()


def line(m: dict) -> str:
    """The machine in one line of a report."""
    prefetch = f", S3D8 next-block prefetch {m['s3d8_next_block_prefetch']}" if m.get("s3d8_next_block_prefetch") else ""
    return (f"{m['cpu']} ({', '.join(m['flags']) or 'no SIMD flags found'}), {m['usable_cpus']} of {m['cpus']} CPUs "
            f"usable, {m['platform']}{prefetch}")


def _proc_mb(path: str, key: str) -> float | None:
    """The ``key: N kB`` line of a ``/proc`` file in MB; None where there is no such file or line."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def anon_huge_pages_mb() -> float | None:
    """This process's anonymous memory backed by transparent huge pages now (``AnonHugePages`` of
    ``/proc/self/smaps_rollup``): where the weights' private block landed on 2 MB pages; None off Linux."""
    return _proc_mb("/proc/self/smaps_rollup", "AnonHugePages")


def peak_rss_mb() -> float:
    """This process's peak resident memory: ``VmHWM`` (reset by exec, unlike ``ru_maxrss``, which a child
    inherits from the parent it was forked from)."""
    peak = _proc_mb("/proc/self/status", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
