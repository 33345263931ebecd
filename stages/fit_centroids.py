"""DVC stage fit-centroids: fit one format's state (S3D8 tables, code points) to every quantised weight
of the teacher, streaming the checkpoint tensor by tensor.

    python stages/fit_centroids.py --format s3d8

Writes ``data/centroids/<format>.safetensors``, ``reports/centroids/<format>.json`` (metrics: relative
RMSE, bits per parameter) and ``reports/centroids/<format>_layers.json`` (the same per matrix).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
from pipeline import formats, params
from pipeline.cast.fit import FitParams, fit_model
from pipeline.files.atomic import write_json
from pipeline.stage import console, run_log, set_threads, stage_errors, versions
from pipeline.teacher.source import TeacherParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, help=f"one of {', '.join(formats.QUANTISED)}")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    with stage_errors("fit-centroids"):
        fmt = formats.comparison(args.format, "--format")
        fit = params.load(FitParams, "fit", args.params)
        teacher = params.load(TeacherParams, "teacher", args.params)
        set_threads(fit.threads)
        began = time.perf_counter()
        states, report = fit_model(fmt, teacher.dir, fit.seed)
        fmt.save_states(f"data/centroids/{fmt.name}.safetensors", states,
                        {"seed": fit.seed, "teacher": teacher.source, **versions()})
        write_json(f"reports/centroids/{fmt.name}.json", report["summary"])
        write_json(f"reports/centroids/{fmt.name}_layers.json", {"params": asdict(fit), **versions(),
                                                                 "layers": report["layers"]})
        run_log(f"fit-centroids-{fmt.name}", seconds=round(time.perf_counter() - began, 2))
        s = report["summary"]
        console.print(f"[green]fit-centroids[/] {fmt.name}: {s['matrices']} matrices, "
                      f"{s['bits_per_param']:.3f} bits/param, relative RMSE {s['rel_rmse']:.4f}")


if __name__ == "__main__":
    main()
