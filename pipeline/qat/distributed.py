"""FSDP2 for QAT (``launch.strategy: fsdp2``): the student's fp32 masters sharded over the ranks, sharded
checkpoints that reshard on resume, and the final student gathered once.

Sharding units (``torch.distributed.fsdp.fully_shard``): every decoder layer of the language model (self- and
cross-attention), every layer of the vision encoder's local and global transformers, the token embedding and
``lm_head``; the root (patch and position embeddings, norms, the projector) holds the rest. Parameters stay fp32
masters (the optimizer state is sharded with them); ``launch.compute_dtype: bfloat16`` gathers them in bf16 for
forward and backward and reduces gradients in fp32 (``MixedPrecisionPolicy``), except the fake-quantised modules:
each is a unit of its own gathered in fp32, so the quantiser and the learned scales see the masters (the values
pack-safetensors writes), and only the product runs in bf16. Gradients are averaged over
ranks, as under DDP, so the loss scaling of ``pipeline.qat.train`` holds for both.

A checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP: each rank's tensor shards, the
model's and the optimizer moments; no Python objects) plus ``meta.json`` (step, history, fingerprint, world
size). DCP's index (``.metadata``) is a pickle: it is read by an unpickler that builds only DCP's own metadata
classes, torch sizes and dtypes, so a planted pickle cannot run code; tensors are read with
``torch.load(weights_only=True)``, as DCP does. DCP reshards on load, so a run killed on N processes resumes on M. The directory is written beside its
final name and swapped in whole. On several machines it must be on a file system they share.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipeline.models import sharding_units
from pipeline.launch.processes import device
from pipeline.recipe import Quantised

META = "meta.json"


class ReshardError(ValueError):
    """A checkpoint written by another number of processes cannot be loaded onto this many: stop, naming it
    (starting afresh would silently throw its steps away)."""


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """Join the ranks torchrun started, or form a group of one (a single process runs FSDP2 too); ``timeout``
    bounds every collective (``pipeline.launch.ranks``)."""
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def shard(model: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` every unit of :func:`sharding_units`, then the root; in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    if compute_dtype is None:
        policy = exact = MixedPrecisionPolicy()
    else:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        # the fake-quantised modules gathered in fp32: their quantiser runs on the masters and learned scales, as
        # pack-safetensors does; what comes out enters the product in the compute dtype
        exact = MixedPrecisionPolicy(reduce_dtype=torch.float32, output_dtype=compute_dtype, cast_forward_inputs=False)
    units = sharding_units(model)
    if compute_dtype is not None:
        owned = {id(m.weight) for _, m in units if isinstance(m, Quantised)}
        for module in model.modules():
            # each fake-quantised module not a unit already nor tied to one (a tied lm_head)
            if isinstance(module, Quantised) and id(module.weight) not in owned:
                owned.add(id(module.weight))
                fully_shard(module, mesh=mesh, mp_policy=exact)
    for _, module in units:
        fully_shard(module, mesh=mesh, mp_policy=exact if isinstance(module, Quantised) else policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def fill_from_rank0(model: nn.Module, full: nn.Module | None, device: torch.device) -> None:
    """Allocate the shards of ``model`` (built on ``meta`` and sharded) on ``device`` and fill them from rank 0's
    whole copy ``full`` (None on the other ranks), one tensor at a time: parameters and persistent buffers
    through ``set_model_state_dict(broadcast_from_rank0=True)``, the buffers a checkpoint never holds (rotary
    frequencies, the fitted quantiser state) by a broadcast each."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = dist.get_rank() == 0
    if rank0 and full is None:
        raise ValueError("fill_from_rank0: rank 0 must hold the whole model")
    model.to_empty(device=device)
    source = dict(full.named_buffers()) if rank0 else {}
    for name, buffer in model.named_buffers():
        if rank0:
            buffer.copy_(source[name])
        dist.broadcast(buffer, src=0)
    set_model_state_dict(model, full.state_dict() if rank0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _paths(path: Path) -> tuple[Path, Path]:
    return path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")


def sweep(path: Path) -> None:
    """Remove what a killed save left beside the checkpoint (rank 0)."""
    for leftover in _paths(path):
        shutil.rmtree(leftover, ignore_errors=True)


def save(path: Path, model: nn.Module, optimizer, step: int, history: list, fingerprint: str) -> None:
    """A sharded checkpoint of model and optimizer (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp, old = _paths(path)
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # Tensors only: the optimizer's hyper-parameters come from the parameters (the fingerprint covers them).
    dcp.save({"model": model_sd, "optim": optim_sd["state"]}, checkpoint_id=str(tmp))
    dist.barrier()
    if rank0:
        meta = {"step": step, "history": history, "fingerprint": fingerprint, "world_size": dist.get_world_size()}
        (tmp / META).write_text(json.dumps(meta))
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def read_meta(path: Path, fingerprint: str) -> dict:
    """The checkpoint's metadata; ``ValueError`` (start afresh) if unreadable or from other inputs."""
    try:
        meta = json.loads((path / META).read_text())
        int(meta["step"]), list(meta["history"]), int(meta["world_size"])
    except Exception as e:  # noqa: BLE001  (missing, truncated, foreign)
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from None
    if meta.get("fingerprint") != fingerprint:
        raise ValueError(f"{path} is from other parameters or data")
    return meta


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` index, built from an allow-list: DCP's metadata classes, torch sizes and dtypes."""

    def find_class(self, module: str, name: str):
        value = None
        if module.startswith("torch.distributed.checkpoint.") and "." not in name:
            value = getattr(__import__(module, fromlist=[name]), name, None)
            value = value if isinstance(value, type) else None
        elif module == "torch" and name in ("Size", "float32", "bfloat16", "float16", "float64", "int64", "int32",
                                            "uint8", "int8", "bool", "strided", "contiguous_format", "preserve_format"):
            value = getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):     # a layout by its name
            value = torch.serialization._get_layout
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            value = getattr(__import__("pathlib"), name)     # the checkpoint's own path, recorded by DCP
        elif (module, name) in (("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                                ("builtins", "slice")):
            value = getattr(__import__(module), name)
        if value is None:
            raise pickle.UnpicklingError(f"checkpoint index refers to {module}.{name}, which is not checkpoint metadata")
        return value


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def load(path: Path, model: nn.Module, optimizer, fingerprint: str) -> tuple[int, list]:
    """Restore a sharded checkpoint onto this run's ranks, resharding when the world size differs.

    ``ValueError`` when it is unreadable or from other inputs (the caller starts afresh); :class:`ReshardError`
    naming the directory when it was written by another number of processes and cannot be loaded onto this
    many."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = read_meta(path, fingerprint)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd["state"]}
    try:
        dcp.load(state, storage_reader=_reader(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (CheckpointException is a BaseException)
        world = dist.get_world_size()
        if meta["world_size"] == world:
            raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__})") from None
        raise ReshardError(f"{path}: written by {meta['world_size']} process(es), cannot be loaded onto {world} "
                           f"({_root_cause(e)}); delete it to "
                           f"start afresh, or resume on {meta['world_size']}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"], "param_groups": optim_sd["param_groups"]})
    return int(meta["step"]), list(meta["history"])


def _root_cause(e: BaseException) -> str:
    """One line: the first rank's own error inside DCP's ``CheckpointException``, else ``e`` itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        if isinstance(inner, tuple):                # CheckpointException keeps (exception, traceback) pairs
            inner = inner[0]
        return f"rank {rank}: {type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on rank 0's CPU (gathered tensor by tensor; other ranks get ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
