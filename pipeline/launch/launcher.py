"""Launch a stage script on one process or several, from the ``launch`` section of ``params.yaml``.

    python -m pipeline.launch stages/qat_train.py --format s3d8      # what dvc.yaml runs
    dvc exp run -S launch.num_processes=2 -S launch.strategy=fsdp2     # the same stages on 2 processes

With ``launch.num_processes: 1`` (the default) the script is exec'd directly, exactly as
``python stages/qat_train.py`` would run it. With N > 1 it is exec'd under ``torchrun``
(``python -m torch.distributed.run``), which starts N ranks (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the
environment); the scripts pick them up through ``accelerate`` (DDP) or ``pipeline.qat.distributed`` (FSDP2).
The process-group backend is gloo on CPU and NCCL on GPU (``launch.backend: auto``).

``launch.config_file`` names a torchrun topology file for several machines (``configs/launch/*.torchrun.yaml``:
``num_machines``, ``main_address``, ``main_port``, ``rdzv_id``; the machine's rank from ``$MACHINE_RANK``);
``launch.num_processes`` counts the processes of all machines together. The resolved settings are handed to
the script in ``$PIPELINE_LAUNCH`` (JSON), so a script reads the same settings the launcher used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from pipeline.params import ParamsError
from pipeline.launch.processes import ENV, LaunchParams, from_file, read_topology


def command(script: str, args: list[str], p: LaunchParams) -> list[str]:
    """The command line that runs ``script`` under the settings ``p``."""
    if p.num_processes < 1:
        raise ParamsError(f"parameter 'launch.num_processes': {p.num_processes} must be >= 1")
    processes = p.num_processes
    if p.config_file is None and processes == 1:
        return [sys.executable, script, *args]
    run = [sys.executable, "-m", "torch.distributed.run"]
    if p.config_file is None:
        return [*run, "--standalone", "--nnodes", "1", "--nproc-per-node", str(processes), script, *args]
    topo = read_topology(p.config_file)
    if processes % topo.num_machines:
        raise ParamsError(f"parameter 'launch.num_processes'={processes} is not a multiple of num_machines="
                          f"{topo.num_machines} in {p.config_file}")
    rank = topo.machine_rank
    if rank is None:
        rank = int(os.environ.get("MACHINE_RANK", os.environ.get("NODE_RANK", "0")))
    if not 0 <= rank < topo.num_machines:
        raise ParamsError(f"machine rank {rank} is outside [0, {topo.num_machines}) ({p.config_file})")
    return [*run, "--nnodes", str(topo.num_machines), "--node-rank", str(rank),
            "--nproc-per-node", str(processes // topo.num_machines), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{topo.main_address}:{topo.main_port}", "--rdzv-id", topo.rdzv_id, script, *args]


def plan_main(argv: list[str]) -> int:
    """``python -m pipeline.launch plan``: the memory and disk plan of this run (:mod:`pipeline.launch.memory_plan`) for the
    params with ``--preset`` files applied (as ``python -m pipeline.params apply`` would) on the teacher's config
    (``--config``, else ``memory_plan.teacher_config``'s choice); it names the model it planned. Exit status 1 when
    a phase does not fit."""
    import argparse

    from pipeline import params
    from pipeline.launch import memory_plan

    ap = argparse.ArgumentParser(prog="python -m pipeline.launch plan",
                                 description="per-GPU and per-node host memory and the disk of every stage and phase "
                                             "of this run")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--preset", action="append", default=[], metavar="FILE",
                    help="a preset (configs/*.yaml) applied to the params first; repeat for several, in order")
    ap.add_argument("--config", help="the teacher's directory, its config.json, or a hub id whose config.json is in "
                                     "the Hugging Face cache (default: teacher.dir if imported from teacher.source, "
                                     "else teacher.source)")
    ap.add_argument("--gpu-memory-gb", type=float, help="memory of one GPU (default: this machine's GPU, if any)")
    ap.add_argument("--host-memory-gb", type=float, help="host RAM of one node (default: this machine's)")
    args = ap.parse_args(argv)
    try:
        params.read(args.params)                     # the file alone valid first: an error names it and the key
        doc = params.load_yaml(args.params)
        for preset in args.preset:
            if not Path(preset).is_file():
                raise FileNotFoundError(f"--preset {preset}: no such file (the presets are configs/*.yaml)")
            doc = params.merge(doc, params.load_yaml(preset) or {})
        p = params.validate(doc, " + ".join([args.params, *args.preset]))
        config, config_path = memory_plan.teacher_config(p, args.config)
        counts = memory_plan.count_params(config)
        cache_dir, copies = memory_plan.dvc_cache()
        phases = memory_plan.plan(p, config, counts, cache_copies=copies)
        gpu, host = memory_plan.memory_available(args.gpu_memory_gb, args.host_memory_gb)
        disk = memory_plan.disk_available(".", cache_dir)
        launch = p["launch"]
        per_node = launch.num_processes // launch.machines()
    except (ParamsError, FileNotFoundError, ValueError) as e:
        print(f"launch plan: error: {e}", file=sys.stderr)
        return 1
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    print(f"plan of {p['teacher'].name}: {arch}, {counts['total'] / 1e9:.2f} B parameters "
          f"({counts['quantised'] / 1e9:.2f} B quantised), config {config_path}\n"
          f"params {' + '.join([args.params, *args.preset])}: {launch.num_processes} process(es), {launch.strategy}, "
          f"formats {', '.join(p['formats'])}")
    print(memory_plan.summary(phases, gpu, host, disk))
    from pipeline.launch import ranks
    for line in ranks.planned_waits(p, counts):
        print(f"wait: {line}")
    problems = memory_plan.check(phases, gpu, host, per_node) + memory_plan.check_disk(phases, disk)
    for line in problems:
        print(f"does not fit: {line}", file=sys.stderr)
    return 1 if problems else 0


def _memory_check(script: str, args: list[str], params_path: str, p: LaunchParams) -> None:
    """Refuse to start a stage whose memory or disk plan does not fit this machine (``S3D8_MEMORY_CHECK=0``: skip);
    the disk it needs (its outputs and checkpoints, of its ``--format`` alone) is checked against the free space
    now, where the stages before it have left theirs."""
    if os.environ.get("S3D8_MEMORY_CHECK", "1") == "0":
        return
    from pipeline import params
    from pipeline.launch import memory_plan

    doc = params.read(params_path)
    stage = memory_plan.stage_of(script)
    if not (Path(doc["teacher"].dir) / "config.json").is_file():
        return                                           # teacher-import has not run: nothing to plan from
    if "--format" in args[:-1]:
        doc["formats"] = [args[args.index("--format") + 1]]
    cache_dir, copies = memory_plan.dvc_cache()
    try:
        phases = [ph for ph in memory_plan.plan(doc, cache_copies=copies) if ph.stage == stage]
    except Exception as e:  # noqa: BLE001  (a model the estimates do not cover must not stop the run)
        print(f"launch: no memory plan for {script} ({type(e).__name__}: {e})", file=sys.stderr)
        return
    if not phases:
        return
    gpu, host = memory_plan.memory_available()
    problems = memory_plan.check(phases, gpu, host, p.num_processes // p.machines())
    problems += memory_plan.check_disk(phases, memory_plan.disk_available(".", cache_dir))
    if problems:
        raise ValueError("the memory plan does not fit this machine (python -m pipeline.launch plan; "
                         "S3D8_MEMORY_CHECK=0 to start anyway): " + "; ".join(problems))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        raise SystemExit(plan_main(argv[1:]))
    params_path = "params.yaml"
    if argv[:1] == ["--params"] and len(argv) > 1:       # the launcher's own --params, before the script
        params_path, argv = argv[1], argv[2:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0] + "\n\nusage: python -m pipeline.launch [--params FILE] SCRIPT [ARGS...]\n"
              "       python -m pipeline.launch plan [--params FILE] [--preset FILE]... [--config DIR|REPO] "
              "[--gpu-memory-gb N] [--host-memory-gb N]")
        raise SystemExit(0 if argv else 2)
    script, args = argv[0], argv[1:]
    if "--params" in args[:-1]:                        # the script's --params is the launcher's too
        params_path = args[args.index("--params") + 1]
    try:
        from pipeline import params
        params.read(params_path)                       # the whole file, validated: one line naming a bad key
        p = from_file(params_path)
        if not Path(script).is_file():
            raise FileNotFoundError(f"{script}: script not found")
        cmd = command(script, args, p)
        _memory_check(script, args, params_path, p)
    except (ParamsError, FileNotFoundError, ValueError) as e:
        print(f"launch: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    os.environ[ENV] = json.dumps(dataclasses.asdict(p))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
