"""How QAT runs on one process or several: the engine behind each ``launch.strategy`` (loading the teacher and the
student, the optimizer's wrapping, gradients, checkpoints, saving the student) and the checkpoint files.

Checkpoints hold no pickle: under DDP (and on one process) tensors (model, optimizer moments) in safetensors,
everything else (step, history, optimizer hyper-parameters, fingerprint) in its JSON metadata; under FSDP2 a
``torch.distributed.checkpoint`` directory (``<name>.dcp/``: each rank's shards, resharded on load to another
process count) with ``meta.json``. A checkpoint that cannot be read, or that was written for other parameters or
data, is a ValueError: the loop reports it and starts afresh.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from pipeline.launch import ranks
from pipeline.files.atomic import atomic_dir
from pipeline.launch.processes import LaunchParams
from pipeline.models import load_config, load_model, meta_model
from pipeline.qat.modules import _FakeQuant
from pipeline.teacher.source import teacher_bytes
from pipeline.packed.safetensors_io import write_tensors


QAT_STATE = "qat_state.safetensors"
"""Beside the student's fp32 masters: per quantised weight ``P`` the quantiser state it was trained with
(``P.table`` or ``P.codepoints``) and, with learned scales, ``P.scale`` (bf16); pack-safetensors packs with them."""

def split_state(state: dict, model) -> tuple[dict, dict, dict]:
    """From a full state dict: ``({module: weight}, {module: learned log2 scale}, {module: fake-quant module})``."""

    modules = {n: m for n, m in model.named_modules() if isinstance(m, _FakeQuant)}
    weights = {n: state[f"{n}.weight"] for n in modules}
    scales = {n: state[f"{n}.qat_log2_scale"] for n in modules if f"{n}.qat_log2_scale" in state}
    return weights, scales, modules

def train_mode(student, launch: LaunchParams) -> None:
    student.train()
    if launch.gradient_checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

def save_checkpoint(path: Path, model, optimizer, step: int, history: list, fingerprint: str) -> None:
    """Model and optimizer tensors as safetensors; step, history and optimizer settings as JSON metadata."""
    names = {id(p): n for n, p in model.named_parameters()}
    opt = optimizer.state_dict()
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    for index, state in opt["state"].items():
        for key, value in state.items():
            tensors[f"optim.{ordered[index]}.{key}"] = value.detach().reshape(value.shape).contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    write_tensors(path, tensors, {"step": str(step), "history": json.dumps(history), "fingerprint": fingerprint,
                                  "param_groups": json.dumps(groups), "param_order": json.dumps(ordered)})


def load_checkpoint(path: Path, model, optimizer, fingerprint: str) -> tuple[int, list]:
    """Restore a checkpoint of this run; ``ValueError`` (the caller starts afresh) if it is unreadable,
    foreign or from other parameters or data. Never unpickles anything."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("fingerprint") != fingerprint:
                raise ValueError(f"{path} is from other parameters or data")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        step, history = int(meta["step"]), json.loads(meta["history"])
        groups, ordered = json.loads(meta["param_groups"]), json.loads(meta["param_order"])
    except ValueError:
        raise
    except Exception as e:  # truncated, not safetensors, missing metadata
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from None
    current = [n for n, _ in model.named_parameters()]
    by_name = dict(model.named_parameters())
    if sorted(ordered) != sorted(current) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{path} was written for another model")
    model.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")})
    state = {}
    for index, name in enumerate(ordered):
        entry = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith(f"optim.{name}.")
                 and "." not in k[len(f"optim.{name}."):]}
        if entry:
            state[index] = entry
    ids = [id(p) for group in optimizer.param_groups for p in group["params"]]
    if [id(by_name[n]) for n in ordered] != ids:
        raise ValueError(f"{path}: parameter order differs from this run's optimizer")
    param_groups = []
    start = 0
    for saved, group in zip(groups, optimizer.param_groups):
        count = len(group["params"])
        param_groups.append({**saved, "params": list(range(start, start + count))})
        start += count
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    return step, history

class AccelerateEngine:
    """``launch.strategy: ddp``: one process (exactly the original loop), or DDP under ``accelerate``."""

    def __init__(self, launch: LaunchParams) -> None:
        from accelerate import Accelerator

        ranks.init_process_group(launch)                 # accelerate joins this group
        self.launch = launch
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.device = self.accelerator.device

    def teacher(self, source: str, dtype: torch.dtype):
        self.teacher_dtype = dtype
        return load_model(source, dtype).to(self.device)

    def student(self, source: str, quantise, launch: LaunchParams):
        """The fp32 student, loaded whole on every process (DDP replicates it anyway)."""
        student = load_model(source, torch.float32)
        quantise(student)
        train_mode(student, launch)
        return student

    def prepare(self, student, optimizer):
        return self.accelerator.prepare(student, optimizer)

    def checkpoint_path(self, path: Path) -> Path:
        return path

    def sweep(self, path: Path) -> None:
        pass

    def load(self, path, student, optimizer, fingerprint):
        return load_checkpoint(path, self.accelerator.unwrap_model(student), optimizer, fingerprint)

    def save(self, path, student, optimizer, step, history, fingerprint) -> None:
        """Rank 0 writes the checkpoint (fp32 model and AdamW's two moments) while the others wait for it."""
        model = self.accelerator.unwrap_model(student)
        nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
        ranks.on_rank0(self.launch, nbytes,
                       lambda: save_checkpoint(path, model, optimizer, step, history, fingerprint))

    def reduce_sum(self, tensor):
        return self.accelerator.reduce(tensor, "sum")

    def backward(self, student, loss, sync: bool) -> None:
        if sync:
            self.accelerator.backward(loss)
        else:
            with self.accelerator.no_sync(student):
                self.accelerator.backward(loss)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def save_student(self, student, processor, out_dir, quantiser_state, fmt_name: str):
        if not self.accelerator.is_main_process:
            return None
        model = self.accelerator.unwrap_model(student)
        state = model.state_dict()
        weights, scales, modules = split_state(state, model)
        tensors, refit = quantiser_state(weights, scales, modules)
        with atomic_dir(out_dir) as tmp:
            model.save_pretrained(tmp, state_dict={k: v for k, v in state.items() if not k.endswith(".qat_log2_scale")})
            processor.save_pretrained(tmp)
            write_tensors(tmp / QAT_STATE, tensors, {"format": fmt_name})
        return refit

    def finish(self, checkpoint: Path) -> None:
        if self.accelerator.is_main_process:
            checkpoint.unlink(missing_ok=True)


class FSDP2Engine:
    """``launch.strategy: fsdp2``: the student sharded per layer (``pipeline.qat.distributed``)."""

    def __init__(self, launch: LaunchParams) -> None:
        from pipeline.qat import distributed

        self.d = distributed
        self.launch = launch
        distributed.init_process_group(ranks.resolve_backend(launch.backend), ranks.timeout(launch))
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.device = distributed.device()

    def teacher(self, source: str, dtype: torch.dtype):
        """The frozen teacher whole on every rank (``launch.teacher: replicate``), or sharded: then, as for the
        student, rank 0 alone reads the checkpoint and the others receive their shards from it (at 11B no rank
        but one holds the 21 GB bf16 copy a node would otherwise hold once per GPU)."""
        self.teacher_dtype = dtype
        if self.launch.teacher != "shard":
            return load_model(source, dtype).to(self.device)
        full = ranks.on_rank0(self.launch, teacher_bytes(source), lambda: load_model(source, dtype))
        model = meta_model(load_config(source), dtype).eval()
        self.d.shard(model)
        self.d.fill_from_rank0(model, full, self.device)
        return model

    def student(self, source: str, quantise, launch: LaunchParams):
        """The sharded fp32 student: rank 0 alone reads the checkpoint; every rank builds the model on ``meta``,
        shards it, allocates its own shards and receives them from rank 0 tensor by tensor, so no other rank
        ever holds the whole model (at 11B: 42 GB of fp32 per process that a node would otherwise hold 8
        times)."""
        dtype = torch.bfloat16 if launch.compute_dtype == "bfloat16" else None

        def read():
            full = load_model(source, torch.float32)
            quantise(full)
            return full

        # rank 0 reads the teacher's files and, with qat.init ptq, the cast's fp32 masters (twice their bf16 bytes)
        full = ranks.on_rank0(launch, 3 * teacher_bytes(source), read)
        student = meta_model(load_config(source), torch.float32)
        quantise(student)
        train_mode(student, launch)
        self.d.shard(student, dtype)
        self.d.fill_from_rank0(student, full, self.device)
        # Rank 0 keeps the loaded model's skeleton (no memory): saving through it writes the checkpoint's own
        # tensor names and generation settings, exactly as the one-process run's save_pretrained does.
        self.template = full.to("meta") if full is not None else None
        return student

    def prepare(self, student, optimizer):
        return student, optimizer

    def checkpoint_path(self, path: Path) -> Path:
        return path.with_suffix(".dcp")

    def sweep(self, path: Path) -> None:
        if self.rank == 0:
            self.d.sweep(path)
        self.barrier()

    def load(self, path, student, optimizer, fingerprint):
        return self.d.load(path, student, optimizer, fingerprint)

    def save(self, path, student, optimizer, step, history, fingerprint) -> None:
        self.d.save(path, student, optimizer, step, history, fingerprint)

    def reduce_sum(self, tensor):
        torch.distributed.all_reduce(tensor)
        return tensor

    def backward(self, student, loss, sync: bool) -> None:
        # every micro-batch's gradients reduce-scattered at once (``sync`` ignored): between micro-batches a rank
        # holds only its shard of them; deferring the sync would keep each unit's whole fp32 gradient on every rank
        loss.backward()

    def barrier(self) -> None:
        torch.distributed.barrier()

    def save_student(self, student, processor, out_dir, quantiser_state, fmt_name: str):
        state = self.d.full_state_dict(student)          # collective; rank 0 holds it, on CPU
        nbytes = sum(p.numel() * 4 for p in student.parameters())

        def write():
            weights, scales, modules = split_state(state, student)
            tensors, refit = quantiser_state(weights, scales, modules)
            with atomic_dir(out_dir) as tmp:
                self.template.save_pretrained(tmp, state_dict={k: v for k, v in state.items()
                                                               if not k.endswith(".qat_log2_scale")})
                processor.save_pretrained(tmp)
                write_tensors(tmp / QAT_STATE, tensors, {"format": fmt_name})
            return refit

        refit = ranks.on_rank0(self.launch, nbytes, write)
        del state
        return refit

    def finish(self, checkpoint: Path) -> None:
        """The sharded checkpoint removed by rank 0 while the others wait as long as its bytes allow."""
        size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) if checkpoint.exists() else 0
        ranks.on_rank0(self.launch, size, lambda: shutil.rmtree(checkpoint, ignore_errors=True))
