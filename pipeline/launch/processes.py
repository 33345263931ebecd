"""The launch settings a stage runs under (the ``launch`` section of ``params.yaml``, or what the launcher handed
over in ``$PIPELINE_LAUNCH``), the device a rank computes on, and the process group's end: what a stage script needs
of its processes. Starting them (one process, or several under torchrun) and checking the memory plan first is the
launcher's (:mod:`pipeline.launch`)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from pipeline.section import ParamsError, defaults, from_dict, load_yaml, non_negative, positive

ENV = "PIPELINE_LAUNCH"


@dataclass
class LaunchParams:
    num_processes: int = positive()                # all machines together; 1: the script runs directly, no torchrun
    config_file: str | None                        # torchrun topology of several machines (configs/launch/)
    backend: Literal["auto", "gloo", "nccl"]       # auto: nccl on GPU, gloo on CPU
    strategy: Literal["ddp", "fsdp2"]              # qat-train: replicated student (DDP) or sharded (FSDP2)
    compute_dtype: Literal["float32", "bfloat16"]  # fsdp2: the dtype of the gathered weights
    gradient_checkpointing: bool                   # qat-train: recompute activations in the backward pass
    teacher: Literal["replicate", "shard"]         # fsdp2: the frozen teacher whole on every rank, or sharded
    timeout_s: float = positive()                  # every collective's (pipeline.launch.ranks)
    min_disk_mb_s: float = positive()              # the slowest read or write a wait for rank 0's allows

    def machines(self) -> int:
        """The machines the run spans: the topology's ``num_machines``, 1 without one."""
        return 1 if self.config_file is None else read_topology(self.config_file).num_machines


@dataclass
class Topology:
    """A torchrun topology file (``launch.config_file``)."""
    num_machines: int = positive(1)
    main_address: str = "127.0.0.1"
    main_port: int = positive(29500)
    rdzv_id: str = "s3d8"
    machine_rank: int | None = non_negative(None)   # null: $MACHINE_RANK (or $NODE_RANK), else 0


def settings(params_path: str | Path = "params.yaml") -> LaunchParams:
    """The launch settings of this run: those the launcher handed over (``$PIPELINE_LAUNCH``), else the
    ``launch`` section of ``params_path`` when it exists, else the defaults (one process, DDP)."""
    if os.environ.get(ENV):
        return from_dict(LaunchParams, json.loads(os.environ[ENV]), prefix="launch")
    return from_file(params_path)


def from_file(params_path: str | Path) -> LaunchParams:
    """The ``launch`` section of ``params_path`` (the project's when the file or the section is absent)."""
    if Path(params_path).is_file():
        doc = load_yaml(params_path) or {}
        if isinstance(doc, dict) and "launch" in doc:
            return from_dict(LaunchParams, doc["launch"] or {}, prefix="launch")
    return defaults(LaunchParams, "launch")


def read_topology(path: str | Path) -> Topology:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"parameter 'launch.config_file': {path} not found")
    try:
        doc = load_yaml(path)
    except Exception as e:  # noqa: BLE001  (any YAML error)
        raise ParamsError(f"parameter 'launch.config_file': {path} is not valid YAML ({e})") from None
    return from_dict(Topology, doc or {}, prefix=f"launch.config_file {path}:")


@contextmanager
def keep_freed_memory():
    """Within it, glibc's ``malloc`` keeps what a step frees for the next one (mallopt(3): ``M_MMAP_MAX`` 0, every
    block from the heap instead of a mapping of its own; ``M_TRIM_THRESHOLD`` -1, the heap never trimmed). A step of
    a real model's QAT allocates and frees the same few GB (logits, activations, gradients); by default each block
    over the mapping threshold (at most 32 MB) is mapped at ``malloc``, unmapped at ``free``, and its pages faulted
    in and zeroed by the kernel again on the next step: a quarter of a SmolLM2 QAT step's time on 2 cores. The
    results are the same bytes. On leaving, glibc's default limits are set back (as fixed thresholds) and the free
    heap is handed back to the system (``malloc_trim``), so a process that goes on (a test running a stage in
    process) is not left holding its peak. Yields False where the C library is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        libc = None
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):   # another libc's mallopt takes other numbers
        yield False
        return
    m_trim_threshold, m_mmap_max = -1, -4
    kept = bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, -1))
    try:
        yield kept
    finally:
        libc.mallopt(m_mmap_max, 65536)                  # glibc's defaults (DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD)
        libc.mallopt(m_trim_threshold, 128 * 1024)
        libc.malloc_trim(0)


def run_stage(main: Callable[[], object]) -> None:
    """Run a launched stage script's ``main``, then leave the process group it formed (through ``accelerate``
    or ``pipeline.qat.distributed``), on return and on error alike: accelerate's ``end_training`` convention.
    A gloo group left to the interpreter's exit can abort the process (``terminate called without an active
    exception``, exit code -6) after a clean error that should exit with 1. A group that was formed before the
    call is left alone. On the CPU, freed memory is kept for reuse (:func:`keep_freed_memory`)."""
    import torch.distributed as dist
    owned = not dist.is_initialized()
    # On a GPU the steps' tensors are CUDA's (its allocator caches them), and the host memory a load frees (11B: tens
    # of GB on rank 0) should go back to the system.
    kept = keep_freed_memory() if not torch.cuda.is_available() else nullcontext()
    try:
        with kept:
            main()
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def device() -> torch.device:
    """The device this rank computes on: its GPU (``LOCAL_RANK``) where there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
