"""DVC stage direct-cast: cast the teacher to one format by ``pack.method``, once, for qat-train and pack-safetensors.

    python -m pipeline.launch stages/direct_cast.py --format s3d8    # launch.num_processes processes share it

Starts from fit-centroids' fitted state of each weight (``data/centroids/<format>.safetensors``); ``gptq`` reads
the calibrate stage's ``X^T X``, or with ``calibrate.sequential`` runs the teacher over the calibration text itself and
casts the layers in order (``pipeline.sequential``). Writes ``models/direct-cast/<format>/`` (``pipeline/direct_cast.py``): the packed
tensors pack-safetensors writes and the float32 start of QAT, one file per decoder layer, the layers dealt to the
processes, each on its GPU where it has one (else the CPU; the index records which: GPU arithmetic can round a
few codes differently). A killed run resumes from the layers it finished (``checkpoints/direct-cast/<format>/``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
import torch
from pipeline import direct_cast, formats, params, ranks
from pipeline.calibrate import CALIBRATION, Calibration, calibration_fingerprint, calibration_inputs
from pipeline.checkpoint import CheckpointReader
from pipeline.fit import check_states
from pipeline.formats.base import check_weight
from pipeline.io import atomic_dir
from pipeline.processes import run_stage
from pipeline.processes import settings as launch_settings
from pipeline.precision import Precision
from pipeline.models import load_config, load_model, load_processor, meta_model, quantised_weight_names, token_ids
from pipeline.answers import model_inputs
from pipeline.processes import device
from pipeline.filehash import file_hash
from pipeline.stage import console, progress, run_log, set_threads, stage_errors, versions
from pipeline.teacher_source import local_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, help=f"one of {', '.join(formats.QUANTISED)}")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--teacher-data", default="data/teacher", help="the teacher's answers (calibrate.source "
                        "teacher-answers, calibrate.sequential)")
    args = parser.parse_args(argv)
    with stage_errors("direct-cast"):
        fmt = formats.comparison(args.format, "--format")
        doc = params.read(args.params)
        method, teacher, cal = doc["pack"].method, doc["teacher"], doc["calibrate"]
        state_file = Path(f"data/centroids/{fmt.name}.safetensors")
        states = check_states(fmt, fmt.load_states(state_file), state_file)
        if method == "gptq" and not cal.sequential and not Path(CALIBRATION).exists():
            raise ValueError(f"parameter pack.method=gptq needs {CALIBRATION} (stage calibrate)")
        calibration = Calibration(CALIBRATION if method == "gptq" and not cal.sequential else None)
        root = local_dir(teacher.dir)
        reader = CheckpointReader(root)
        plan = Precision(fmt, doc["pack"].precision)
        names = [n for n in dict.fromkeys(n.removesuffix(".weight")
                                          for n in quantised_weight_names(meta_model(load_config(str(root)))).values())
                 if plan.format_of(n) is not None]
        missing = [n for n in names if n not in states and plan.format_of(n) is fmt]
        if missing:
            raise ValueError(f"{state_file}: no fitted state for {missing[:3]} (fitted to another teacher? "
                             "dvc repro fit-centroids)")
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(direct_cast.group_of(name), []).append(name)
        costs = {g: sum(direct_cast.gptq_cost(reader.shape(f"{n}.weight")) for n in ns) for g, ns in groups.items()}

        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        # torchrun sets one thread per process; the bytes do not depend on the count (tested), so each process
        # takes its share of the machine's cores
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        set_threads(max(1, len(os.sched_getaffinity(0)) // local))
        in_order = method == "gptq" and cal.sequential
        on = device()             # this process's GPU where there is one: the searches and GPTQ run there
        launch = launch_settings()
        if world > 1:
            ranks.init_process_group(launch, backend="gloo")
        # rank 0 hashes what determines the bytes (the teacher's weights, the calibration file: cached by path, size
        # and modification time) while the others wait as long as reading them takes
        read = [*root.glob("*.safetensors"), *([Path(CALIBRATION)] if calibration.path else [])]
        fp = ranks.on_rank0(launch, sum(f.stat().st_size for f in read), lambda: direct_cast.cast_fingerprint(
            [fmt.name, method, plan.rules, file_hash(state_file), on.type,
             calibration_fingerprint(cal, args.teacher_data) if in_order else None], root, calibration.path), share=True)
        staging = Path(f"checkpoints/direct-cast/{fmt.name}")
        staging.mkdir(parents=True, exist_ok=True)
        mine = (list(groups) if rank == 0 else []) if in_order else direct_cast.deal(costs, world)[rank]
        todo = [g for g in mine if not direct_cast.finished(staging / f"{g}.safetensors", fp)]
        if rank == 0 and len(todo) < len(mine):
            console.print(f"direct-cast {fmt.name}: resuming, {len(mine) - len(todo)} of {len(mine)} files done")

        def weight(name):
            w = reader.get(f"{name}.weight").float()
            check_weight(w, f"{reader.file_of(f'{name}.weight')}: tensor {name}.weight")
            return w.to(on)

        def fitted(name):
            return {k: v.to(on) for k, v in states[name].items()}

        def hessian(name):
            h = calibration.get(name)
            return None if h is None else h.to(on)

        began = time.perf_counter()
        with progress() as bar:
            task = bar.add_task(f"direct-cast {fmt.name} ({method})" + (f" rank {rank}" if world > 1 else ""),
                                total=sum(len(groups[g]) for g in todo))
            if in_order and todo:
                model = load_model(teacher.dir, torch.float32).to(on)
                inputs = [model_inputs(e, model.dtype, on)
                          for e in calibration_inputs(cal, load_processor(teacher.dir), args.teacher_data,
                                                      doc["heldout_prompts"], token_ids(model.config),
                                                      doc["sample"].images, teacher=model)]
                bar.update(task, total=len(names))
                direct_cast.cast_in_order(plan, model, inputs, fitted, method, staging, fp,
                                          on_matrix=lambda: bar.advance(task))
            for g in [] if in_order else todo:
                direct_cast.cast_group(plan, groups[g], weight, fitted, hessian, method,
                                       staging / f"{g}.safetensors", fp, on_matrix=lambda: bar.advance(task))
        if ranks.collect(f"direct-cast-{fmt.name}", None) is None:
            return                                     # rank 0 assembles once every process has handed over
        out_dir = Path(f"models/direct-cast/{fmt.name}")
        with atomic_dir(out_dir) as out:
            for g in groups:                           # linked: a crash here keeps every finished file staged
                _link(staging / f"{g}.safetensors", out / f"{g}.safetensors")
            direct_cast.write_index(out, plan, method, groups,
                                    {"fit_state": file_hash(state_file), "device": on.type, **versions()})
        shutil.rmtree(staging, ignore_errors=True)
        run_log(f"direct-cast-{fmt.name}", seconds=round(time.perf_counter() - began, 1), processes=world)
        console.print(f"[green]direct-cast[/] {plan.describe()} ({method}): {len(names)} matrices in {len(groups)} "
                      f"files -> {out_dir}")


def _link(source: Path, target: Path) -> None:
    """``target`` the same file as ``source`` (a copy where they lie on different file systems)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


if __name__ == "__main__":
    run_stage(main)
