"""DVC stage ``toy-teacher``: build the toy processor, train the tiny Mllama teacher, save it to
``data/toy-teacher/`` (bf16 safetensors, config, generation config, processor files).

    .venv/bin/python stages/toy_teacher.py            # parameters: params.yaml, section toy_teacher

Deterministic for ``toy_teacher.seed`` on the same software: the output folder is replaced atomically (built
beside it, then renamed), and the loss curve goes to ``reports/toy_teacher/loss.csv``.
"""

from __future__ import annotations

import argparse
import csv
import time
from dataclasses import asdict
from pathlib import Path

from pipeline import params
from pipeline.files.atomic import atomic_open, write_json
from pipeline.stage import console, run_log, set_threads, stage_errors, versions
from pipeline.toy.model import count_parameters
from pipeline.toy.settings import ToyTeacherParams
from pipeline.toy.build import save_teacher, train_teacher

REPORTS = Path("reports/toy_teacher")


def inside_project(path: str) -> Path:
    """``toy_teacher.out`` is replaced whole: it must lie inside the project directory."""
    out = Path(path).resolve()
    if out == Path.cwd().resolve() or Path.cwd().resolve() not in out.parents:
        raise ValueError(f"parameter toy_teacher.out={path!r}: must be a directory inside the project "
                         f"({Path.cwd()}), since it is replaced whole")
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    with stage_errors("toy-teacher"):
        run(params.load(ToyTeacherParams, "toy_teacher", args.params))


def run(p: ToyTeacherParams) -> None:
    out = inside_project(p.out)
    set_threads(p.threads)
    t0 = time.perf_counter()
    model, processor, generation_config, rows = train_teacher(p)
    train_seconds = time.perf_counter() - t0
    save_teacher(model, processor, generation_config, out)
    fields = sorted({k for r in rows for k in r}, key=lambda k: (not k.startswith("step"), k.startswith("heldout"), k))
    with atomic_open(REPORTS / "loss.csv", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    write_json(REPORTS / "train.json", {
        "parameters": count_parameters(model),
        "vocabulary": len(processor.tokenizer),
        "final_heldout": {k: v for k, v in rows[-1].items() if k.startswith("heldout/")} if rows else {},
    })
    write_json(REPORTS / "provenance.json", {"params": asdict(p), "versions": versions()})
    run_log("toy-teacher", train_seconds=round(train_seconds, 1), threads=p.threads)
    console.print(f"saved {p.out} after {train_seconds / 60:.1f} min")


if __name__ == "__main__":
    main()
