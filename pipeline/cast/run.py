"""Stage direct-cast's run (``stages/direct_cast.py``): the weights the precision plan quantises, grouped one file per
decoder layer (:func:`pipeline.cast.direct.group_of`) and dealt to the processes, or cast in the model's order by one
process (``calibrate.sequential``); each finished file staged in ``checkpoints/direct-cast/<format>/`` under the
fingerprint of what decides its bytes, so a killed run resumes from it; rank 0 then links them into
``models/direct-cast/<format>/`` with the index. The casting itself is :mod:`pipeline.cast.direct`'s."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from pipeline import cpu_numerics
from pipeline.launch import ranks
from pipeline.teacher.answers import model_inputs
from pipeline.cast.calibrate import CALIBRATION, Calibration, calibration_fingerprint, calibration_inputs
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.cast.direct import (cast_fingerprint, cast_group, cast_in_order, deal, finished, gptq_cost, group_of,
                                  write_index)
from pipeline.files.hashes import file_hash
from pipeline.cast.fit import check_states
from pipeline.formats import FormatBase
from pipeline.formats.base import check_weight
from pipeline.files.atomic import atomic_dir
from pipeline.models import load_config, load_model, load_processor, meta_model, quantised_weight_names, token_ids
from pipeline.formats.precision import Precision
from pipeline.launch.processes import device, settings
from pipeline.stage import console, progress, run_log, set_threads, versions
from pipeline.teacher.source import local_dir

def run(fmt: FormatBase, doc: dict, teacher_data: str) -> None:
    """Stage direct-cast (``stages/direct_cast.py``) for ``fmt`` under the params ``doc``: the weights the precision
    plan quantises, grouped into files and dealt to the processes (one process casts them in order with
    ``calibrate.sequential``), each finished file staged (``checkpoints/direct-cast/<format>/``: a killed run resumes
    from it), then rank 0 links them into ``models/direct-cast/<format>/`` with the index."""
    algorithm, cal = doc["pack"].algorithm, doc["calibrate"]
    state_file = Path(f"data/centroids/{fmt.name}.safetensors")
    states = check_states(fmt, fmt.load_states(state_file), state_file)
    if algorithm == "gptq" and not cal.sequential and not Path(CALIBRATION).exists():
        raise ValueError(f"parameter pack.algorithm=gptq needs {CALIBRATION} (stage calibrate)")
    calibration = Calibration(CALIBRATION if algorithm == "gptq" and not cal.sequential else None)
    root = local_dir(doc["teacher"].dir)
    reader = CheckpointReader(root)
    plan = Precision(fmt, doc["pack"].precision)
    groups = _groups(plan, root, states, state_file)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # torchrun sets one thread per process; the bytes do not depend on the count (tested), so each process takes its
    # share of the machine's cores
    set_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    in_order = algorithm == "gptq" and cal.sequential
    on = device()             # this process's GPU where there is one: the searches and GPTQ run there
    launch = settings()
    if world > 1:
        ranks.init_process_group(launch, backend="gloo")
    # rank 0 hashes what determines the bytes (the teacher's weights, the calibration file: cached by path, size and
    # modification time) while the others wait as long as reading them takes
    read = [*root.glob("*.safetensors"), *([Path(CALIBRATION)] if calibration.path else [])]
    fp = ranks.on_rank0(launch, sum(f.stat().st_size for f in read), lambda: cast_fingerprint(
        [fmt.name, algorithm, plan.rules, file_hash(state_file), on.type, cpu_numerics.pinned(),
         calibration_fingerprint(cal, teacher_data) if in_order else None, cal.act_order], root, calibration.path),
        share=True)
    staging = Path(f"checkpoints/direct-cast/{fmt.name}")
    staging.mkdir(parents=True, exist_ok=True)
    costs = {g: sum(gptq_cost(reader.shape(f"{n}.weight")) for n in ns) for g, ns in groups.items()}
    mine = (list(groups) if rank == 0 else []) if in_order else deal(costs, world)[rank]
    todo = [g for g in mine if not finished(staging / f"{g}.safetensors", fp)]
    if rank == 0 and len(todo) < len(mine):
        console.print(f"direct-cast {fmt.name}: resuming, {len(mine) - len(todo)} of {len(mine)} files done")
    began = time.perf_counter()
    _cast(plan, groups, todo, reader, states, calibration, doc, teacher_data, staging, fp, on, in_order, rank, world)
    if ranks.collect(f"direct-cast-{fmt.name}", None) is None:
        return                                     # rank 0 assembles once every process has handed over
    out_dir = Path(f"models/direct-cast/{fmt.name}")
    _assemble(out_dir, staging, plan, algorithm, groups, {"fit_state": file_hash(state_file), "device": on.type,
                                                          "act_order": cal.act_order})
    run_log(f"direct-cast-{fmt.name}", seconds=round(time.perf_counter() - began, 1), processes=world)
    console.print(f"[green]direct-cast[/] {plan.describe()} ({algorithm}): {sum(map(len, groups.values()))} matrices "
                    f"in {len(groups)} files -> {out_dir}")


def _groups(plan: Precision, root: Path, states: dict, state_file: Path) -> dict[str, list[str]]:
    """The weights the plan quantises (checkpoint names ``P``), grouped by their file (:func:`group_of`); a weight of
    the plan's format without a fitted state is an error naming the state file."""
    names = [n for n in dict.fromkeys(n.removesuffix(".weight")
                                      for n in quantised_weight_names(meta_model(load_config(str(root)))).values())
             if plan.format_of(n) is not None]
    missing = [n for n in names if n not in states and plan.format_of(n) is plan.default]
    if missing:
        raise ValueError(f"{state_file}: no fitted state for {missing[:3]} (fitted to another teacher? "
                         "dvc repro fit-centroids)")
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(group_of(name), []).append(name)
    return groups


def _cast(plan, groups, todo, reader, states, calibration, doc, teacher_data, staging, fp, on, in_order, rank,
          world) -> None:
    """This process's files ``todo``: in the model's order (sequential GPTQ), or group by group."""
    def weight(name):
        w = reader.get(f"{name}.weight").float()
        check_weight(w, f"{reader.file_of(f'{name}.weight')}: tensor {name}.weight")
        return w.to(on)

    def fitted(name):
        return {k: v.to(on) for k, v in states[name].items()}

    def hessian(name):
        h = calibration.get(name)
        return None if h is None else h.to(on)

    fmt, algorithm, teacher = plan.default, doc["pack"].algorithm, doc["teacher"]
    with progress() as bar:
        task = bar.add_task(f"direct-cast {fmt.name} ({algorithm})" + (f" rank {rank}" if world > 1 else ""),
                            total=sum(len(groups[g]) for g in todo))
        if in_order and todo:
            model = load_model(teacher.dir, torch.float32).to(on)
            inputs = [model_inputs(e, model.dtype, on)
                      for e in calibration_inputs(doc["calibrate"], load_processor(teacher.dir), teacher_data,
                                                  doc["heldout_prompts"], token_ids(model.config),
                                                  doc["sample"].images, teacher=model)]
            bar.update(task, total=sum(map(len, groups.values())))
            cast_in_order(plan, model, inputs, fitted, algorithm, staging, fp, on_matrix=lambda: bar.advance(task),
                          act_order=doc["calibrate"].act_order)
        for g in [] if in_order else todo:
            cast_group(plan, groups[g], weight, fitted, hessian, algorithm, staging / f"{g}.safetensors", fp,
                       on_matrix=lambda: bar.advance(task), act_order=doc["calibrate"].act_order)


def _assemble(out_dir: Path, staging: Path, plan: Precision, algorithm: str, groups: dict, extra: dict) -> None:
    """Every staged file linked into ``out_dir`` (a crash here keeps them staged), the index written, the staging
    removed."""
    with atomic_dir(out_dir) as out:
        for g in groups:
            _link(staging / f"{g}.safetensors", out / f"{g}.safetensors")
        write_index(out, plan, algorithm, groups, {**extra, **versions()})
    shutil.rmtree(staging, ignore_errors=True)


def _link(source: Path, target: Path) -> None:
    """``target`` the same file as ``source`` (a copy where they lie on different file systems)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
