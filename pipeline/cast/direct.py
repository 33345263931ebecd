"""The direct cast of the teacher to one format, computed once: stage direct-cast writes it, qat-train starts from
it (``qat.init: ptq``) and pack-safetensors packs it as the direct-cast model.

``models/direct-cast/<format>/`` holds one safetensors file per decoder layer (``model.layers.3.safetensors``)
and one for the other weights (``rest.safetensors``). Per quantised weight ``P`` (of ``P.weight``): the packed
tensors ``P.<suffix>`` as the format's ``pack`` lays them out, and ``P.master``, the float32 weight QAT starts
from (``pipeline.cast.ptq.cast``). ``index.json`` maps each weight to its file and records the format, the algorithm and
each file's sha256.

The work is dealt to processes file by file (``deal``: the largest first, each to the least loaded process), so
several processes (``python -m pipeline.launch``) run the per-matrix searches and GPTQ in parallel and the files
do not depend on how many there were. Each finished file waits in ``checkpoints/direct-cast/<format>/`` (a
directory every process must see: on several machines, a shared file system) until all are done; a killed run
resumes from the files it finished.

With ``calibrate.sequential`` (``pack.algorithm: gptq``) one process casts the layers in the model's order instead
(:func:`cast_in_order`): each matrix's ``X^T X`` comes from the model whose earlier matrices are already cast, so
the layers cannot be dealt out; a killed run still resumes from the layers it finished.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline import formats
from pipeline.cast import ptq, sequential
from pipeline.formats import FormatBase
from pipeline.formats.numerics import GPTQ_ACT_ORDER
from pipeline.formats.precision import Precision
from pipeline.packed.safetensors_io import write_tensors
from pipeline.files.hashes import cached_file_hash, file_hash, file_sha256, fingerprint
from pipeline.files.atomic import atomic_path

INDEX = "index.json"
REST = "rest"


def code_files() -> list[Path]:
    """The source whose code decides a cast's bytes: this module, the algorithms, the formats and the native kernels."""
    pipeline = Path(__file__).resolve().parents[1]
    native = pipeline.parent / "native"
    modules = ("cast/direct", "cast/ptq", "cast/sequential", "quant", "packed/layout", "native",
               "cpu_numerics")
    return ([pipeline / f"{m}.py" for m in modules] + sorted((pipeline / "formats").glob("*.py"))
            + sorted(native.glob("*.[ch]")))


def cast_fingerprint(fixed: list, teacher_dir: Path, calibration: str | None, code: list[Path] | None = None) -> str:
    """What determines a cast's bytes: ``fixed`` (format, algorithm, plan, fitted state, device, ...), the teacher's
    config and weights, the calibration file (``None``: not read) and the casting code (:func:`code_files`). The
    large files are hashed once per (path, size, modification time) (``filehash.cached_file_hash``)."""
    import torch

    weights = {f.name: cached_file_hash(f) for f in sorted(Path(teacher_dir).glob("*.safetensors"))}
    code = code_files() if code is None else code
    return fingerprint(fixed, file_hash(Path(teacher_dir) / "config.json"), weights,
                       cached_file_hash(calibration) if calibration else None,
                       {f.name: file_hash(f) for f in code}, torch.__version__)


def group_of(name: str) -> str:
    """The file a weight goes to: its decoder layer (``...layers.N``), or ``rest``."""
    m = re.match(r"(.*\.layers\.\d+)\.", name)
    return m.group(1) if m else REST


def deal(costs: dict[str, float], world: int) -> list[list[str]]:
    """Groups dealt to ``world`` processes: the largest first, each to the least loaded (ties: the lower rank)."""
    loads, work = [0.0] * world, [[] for _ in range(world)]
    for group in sorted(costs, key=lambda g: (-costs[g], g)):
        r = min(range(world), key=lambda i: (loads[i], i))
        loads[r] += costs[group]
        work[r].append(group)
    return work


def gptq_cost(shape) -> float:
    """A matrix's share of the work: GPTQ's column sweep is ``d_out x d_in^2``."""
    d_out, d_in = shape
    return float(d_out) * d_in * d_in


def cast_one(plan: Precision, name: str, weight: torch.Tensor, algorithm: str, hessian, fitted,
             act_order: bool = GPTQ_ACT_ORDER):
    """``(packed tensors, master)`` of weight ``name`` in its planned format: ``algorithm`` for the plan's comparison
    format (from its ``fitted`` state; GPTQ with ``act_order`` or not), ``absmax`` for the others (INT8's only
    algorithm)."""
    fmt = plan.format_of(name)
    if not fmt.comparison:
        return ptq.cast(fmt, weight, algorithm="absmax")
    return ptq.cast(fmt, weight, algorithm=algorithm, hessian=hessian, fitted=fitted(name), act_order=act_order)


def cast_group(plan: Precision, names: list[str], weight, fitted, hessian, algorithm: str, path: Path,
               fingerprint: str, on_matrix=None, act_order: bool = GPTQ_ACT_ORDER) -> None:
    """Cast the weights ``names`` (checkpoint ``P`` of ``P.weight``) and write them to ``path``: ``weight(P)``,
    ``fitted(P)`` and ``hessian(P)`` give the teacher's weight, the fitted state and ``X^T X`` (or None)."""
    tensors = {}
    for name in names:
        packed, master = cast_one(plan, name, weight(name), algorithm, hessian(name), fitted, act_order)
        tensors.update({f"{name}.{k}": v.cpu().contiguous() for k, v in packed.items()})
        tensors[f"{name}.master"] = master.cpu().contiguous()
        if on_matrix is not None:
            on_matrix()
    write_group(path, tensors, {"format": plan.default.name, "algorithm": algorithm}, fingerprint)


def write_group(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], fingerprint: str) -> None:
    """A group file and, after it, its fingerprint beside it (``P.fingerprint``): the fingerprint stays out of the
    file, so the cast's output has the same bytes whenever the tensors are the same (a code edit that changes
    nothing it computes leaves the stages after it cached)."""
    write_tensors(path, tensors, metadata)
    with atomic_path(path.with_suffix(".fingerprint")) as tmp:
        tmp.write_text(fingerprint)


def cast_in_order(plan: Precision, model, inputs: list[dict], fitted, algorithm: str, staging: Path, fingerprint: str,
                  on_matrix=None, act_order: bool = GPTQ_ACT_ORDER) -> None:
    """The sequential cast (:mod:`pipeline.cast.sequential`) of ``model`` (the teacher in float32, cast in place) over
    the calibration ``inputs``, each decoder layer's file written to ``staging`` as soon as its weights are cast. A file
    finished by an earlier run with the same ``fingerprint`` is read back instead of recast (its decoded weights
    still feed the layers after it)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}

    def cast(name: str, weight: torch.Tensor, hessian):
        fmt = plan.format_of(name)
        if fmt is None:                                        # kept unquantised
            return weight
        path = staging / f"{group_of(name)}.safetensors"
        if finished(path, fingerprint):
            with safe_open(str(path), "pt") as f:
                tensors = {s: f.get_tensor(f"{name}.{s}") for s in fmt.suffixes}
        else:
            tensors, master = cast_one(plan, name, weight, algorithm, hessian, fitted, act_order)
            pending[name] = {**{f"{name}.{k}": v.cpu().contiguous() for k, v in tensors.items()},
                             f"{name}.master": master.cpu().contiguous()}
        if on_matrix is not None:
            on_matrix()
        return fmt.unpack(tensors, tuple(weight.shape)).to(weight.device)

    def done(names: list[str]) -> None:
        for g in sorted({group_of(n) for n in names}):
            mine = [n for n in names if group_of(n) == g and n in pending]
            if mine:
                write_group(staging / f"{g}.safetensors", {k: v for n in mine for k, v in pending.pop(n).items()},
                            {"format": plan.default.name, "algorithm": algorithm}, fingerprint)

    sequential.cast_sequentially(model, inputs, cast, done)


def finished(path: Path, fingerprint: str) -> bool:
    """Whether ``path`` is a group file this run can keep: written for the same inputs (its fingerprint file, written
    after it, says so) and readable."""
    mark = path.with_suffix(".fingerprint")
    if not path.exists() or not mark.exists() or mark.read_text() != fingerprint:
        return False
    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
        return True
    except Exception:           # a foreign or damaged file is redone, never trusted
        return False


def write_index(out: Path, plan: Precision, algorithm: str, groups: dict[str, list[str]], metadata: dict) -> None:
    files = {g: f"{g}.safetensors" for g in groups}
    names = [n for g in groups for n in groups[g]]
    other = {"formats": plan.assigned(names)} if plan.assigned(names) else {}
    doc = {"metadata": {"format": plan.default.name, "algorithm": algorithm, **other, **metadata,
                        "sha256": {files[g]: file_sha256(out / files[g]) for g in sorted(groups)}},
           "weight_map": {n: files[g] for g in sorted(groups) for n in groups[g]}}
    (out / INDEX).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


class DirectCast:
    """A format's direct cast as stage direct-cast wrote it: ``packed(P)`` the tensors pack-safetensors writes,
    ``start(P, weight)`` QAT's start ``(master, state, scale)`` (``ptq.start``'s, bit for bit)."""

    def __init__(self, path: str | os.PathLike, fmt: FormatBase, algorithm: str | None = None) -> None:
        self.path = Path(path)
        index = self.path / INDEX
        if not index.is_file():
            raise ValueError(f"{index}: missing (run stage direct-cast: dvc repro direct-cast)")
        doc = json.loads(index.read_text())
        meta = doc["metadata"]
        if meta["format"] != fmt.name:
            raise ValueError(f"{index}: a direct cast to {meta['format']!r}, not {fmt.name!r}")
        if algorithm is not None and meta["algorithm"] != algorithm:
            raise ValueError(f"{index}: cast by {meta['algorithm']!r}, but parameter pack.algorithm is {algorithm!r} "
                             "(dvc repro direct-cast)")
        self.fmt, self.algorithm, self.weight_map = fmt, meta["algorithm"], doc["weight_map"]
        self.formats = {n: formats.packed(f, f"{index}: metadata 'formats' entry {n!r}")
                        for n, f in meta.get("formats", {}).items()}
        """The weights cast to another format than ``fmt`` (the precision plan's)."""

    def _tensors(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.weight_map:
            raise ValueError(f"{self.path / INDEX}: no weight {name!r} (a cast of another teacher?)")
        with safe_open(str(self.path / self.weight_map[name]), "pt") as f:
            prefix = f"{name}."
            return {k[len(prefix):]: f.get_tensor(k) for k in f.keys()
                    if k.startswith(prefix) and "." not in k[len(prefix):]}

    def packed(self, name: str, shape) -> dict[str, torch.Tensor]:
        tensors = self._tensors(name)
        master = tensors.pop("master")
        if tuple(master.shape) != tuple(shape):
            raise ValueError(f"{self.path / self.weight_map[name]}: {name} is {tuple(master.shape)}, "
                             f"the teacher's weight {tuple(shape)}")
        return tensors

    def start(self, name: str, weight: torch.Tensor):
        tensors = self._tensors(name)
        master = tensors.pop("master")
        if master.shape != weight.shape:
            raise ValueError(f"{self.path / self.weight_map[name]}: {name} is {tuple(master.shape)}, "
                             f"the teacher's weight {tuple(weight.shape)}")
        return master, self.formats.get(name, self.fmt).state_of(tensors), tensors["scale"]
