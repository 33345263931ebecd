"""How the ranks of a launched stage form their process group and wait for one another.

Every collective fails after ``launch.timeout_s`` (NCCL's watchdog then kills the job), so no phase leaves ranks in
a collective while another rank works for longer than that:

- work some ranks have and others lack (eval's models, teacher-generate's pending shards) is never waited for in a
  collective: each rank hands its result to rank 0 through the process group's store and leaves (:func:`collect`).
  Rank 0's wait for them is no collective and has no deadline: torchrun stops every rank when one fails.
- rank 0 alone reading or writing a model while the others wait (qat-train: the teacher and the fp32 student read,
  the student and a DDP checkpoint written) runs in :func:`on_rank0`: the others wait in a gloo group of its own
  whose timeout is the phase's bytes at ``launch.min_disk_mb_s`` on top of ``launch.timeout_s`` (:func:`io_timeout`;
  ``python -m pipeline.launch plan`` lists them).
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
# ``launch`` below: the launch settings (pipeline.launch.processes.LaunchParams; not imported: the launcher's plan reads this)
POLL = timedelta(seconds=30)          # rank 0 looks for the others' results this often (no deadline)


def resolve_backend(backend: str) -> str:
    """``launch.backend``: auto is NCCL on a GPU, gloo on the CPU."""
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def timeout(launch) -> timedelta:
    return timedelta(seconds=launch.timeout_s)


def io_timeout(launch, nbytes: float) -> timedelta:
    """How long ranks wait while rank 0 reads or writes ``nbytes``: at ``launch.min_disk_mb_s``, plus ``timeout_s``."""
    return timedelta(seconds=launch.timeout_s + nbytes / (launch.min_disk_mb_s * 1e6))


def init_process_group(launch, backend: str | None = None) -> None:
    """Join the ranks torchrun started, every collective bounded by ``launch.timeout_s`` (``accelerate`` then joins
    this group), on ``backend`` (default ``launch.backend``'s); nothing on one process or when a group exists."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    backend = backend or resolve_backend(launch.backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout(launch))


def _several() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def on_rank0(launch, nbytes: float, work: Callable[[], T], share: bool = False) -> T | None:
    """``work()`` on rank 0 (its result there, None on the others; with ``share`` on every rank) while the others
    wait for it up to :func:`io_timeout` of ``nbytes``, in a gloo group of its own (formed first, while every rank
    is here)."""
    if not _several():
        return work()
    group = dist.new_group(backend="gloo", timeout=io_timeout(launch, nbytes))
    try:
        result = work() if dist.get_rank() == 0 else None
        if share:
            box = [result]
            dist.broadcast_object_list(box, src=0, group=group)
            result = box[0]
        else:
            dist.barrier(group=group)
    finally:
        dist.destroy_process_group(group)
    return result


def collect(tag: str, obj) -> list | None:
    """Every rank's ``obj`` on rank 0, in rank order; None on the others, which return at once (their ``obj``
    is in the process group's store). One process: ``[obj]``."""
    if not _several():
        return [obj]
    store = dist.distributed_c10d._get_default_store()        # the group's own: torchrun's, or rank 0's
    keys = [f"s3d8/{tag}/{r}" for r in range(1, dist.get_world_size())]
    if dist.get_rank() > 0:
        store.set(keys[dist.get_rank() - 1], pickle.dumps(obj))
        return None
    while True:
        try:
            store.wait(keys, POLL)
            break
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise
    return [obj] + [pickle.loads(store.get(k)) for k in keys]


def planned_waits(params: dict, counts: dict) -> list[str]:
    """A line per phase in which the other ranks wait for rank 0's reads or writes, with the timeout they allow."""
    launch = params["launch"]
    if launch.num_processes == 1:
        return []
    P, tb = counts["total"], 2 if params["teacher"].dtype == "bfloat16" else 4
    waits = {"direct-cast: rank 0 hashes the teacher and calibration (once per size and mtime)":
             tb * P + 4 * counts["calibration_elements"]}
    if launch.strategy == "fsdp2":
        waits["qat-train: rank 0 reads the teacher and the fp32 student (the cast's masters)"] = 3 * tb * P
        waits["qat-train: rank 0 writes the fp32 student"] = 4 * P
    else:
        waits["qat-train: rank 0 writes a checkpoint"] = 12 * P
    return [f"{what}: {nbytes / 1e9:.1f} GB, the others wait up to {io_timeout(launch, nbytes)}"
            for what, nbytes in waits.items()]
