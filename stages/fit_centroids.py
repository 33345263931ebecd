"""DVC stage fit-centroids: fit one format's state (S3D8 tables, code points) to every quantised weight
of the teacher, streaming the checkpoint tensor by tensor.

    python stages/fit_centroids.py --format s3d8

Writes ``data/centroids/<format>.safetensors`` and ``reports/centroids/<format>.json`` (reconstruction
error and bits per parameter, per layer and overall).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

import torch

from pipeline import formats, params
from pipeline.checkpoint import CheckpointReader
from pipeline.io import write_json
from pipeline.models import load_config, meta_model, quantised_weight_names
from pipeline.qat.states import save_states
from pipeline.stage import console, progress, set_threads, stage_errors, versions
from pipeline.teacher import TeacherParams, local_dir


@dataclass
class FitParams:
    seed: int = 0
    threads: int | None = None


def fit_format(fmt_name: str, teacher: TeacherParams, fit: FitParams, out: str, report: str,
               layers_report: str) -> dict:
    fmt = formats.get(fmt_name)
    source = local_dir(teacher.source)
    names = quantised_weight_names(meta_model(load_config(str(source))))
    reader = CheckpointReader(source)
    states, layers = {}, {}
    total_params = total_bits = total_err = total_energy = 0.0
    total_zero_rows = 0
    started = time.perf_counter()
    with progress() as bar:
        task = bar.add_task(f"fit {fmt_name}", total=len(names))
        for saved in names.values():
            weight = reader.get(saved).float()
            try:
                state = fmt.fit(weight, seed=fit.seed)
            except ValueError as e:
                raise ValueError(f"{source}: tensor {saved!r}: {e}") from None
            sq_err = (fmt.quantize(weight, state) - weight).pow(2)
            zero_rows = weight.abs().amax(dim=1) == 0
            # SPEC: an all-zero row gets scale 1, so (in S3D8) it decodes to small integers, not 0.
            # Report that apart: it is real error, but it would drown the error of every other row.
            err, zero_err = sq_err[~zero_rows].sum().item(), sq_err[zero_rows].sum().item()
            energy = weight.pow(2).sum().item()
            bpp = fmt.bits_per_param(tuple(weight.shape))
            states[saved.removesuffix(".weight")] = state
            layers[saved] = {"shape": list(weight.shape), "rel_rmse": (err / energy) ** 0.5 if energy else 0.0,
                             "zero_rows": int(zero_rows.sum()), "zero_rows_sq_error": zero_err,
                             "bits_per_param": bpp}
            total_params += weight.numel()
            total_bits += bpp * weight.numel()
            total_err += err
            total_energy += energy
            total_zero_rows += int(zero_rows.sum())
            bar.advance(task)
    meta = {"seed": fit.seed, "teacher": teacher.source, **versions()}
    save_states(out, fmt_name, states, meta)
    summary = {
        "format": fmt_name,
        "matrices": len(layers),
        "quantised_params": int(total_params),
        "bits_per_param": total_bits / total_params,
        "rel_rmse": (total_err / total_energy) ** 0.5,       # over rows that are not all zero
        "zero_rows": total_zero_rows,
        "seconds": round(time.perf_counter() - started, 2),
        "params": asdict(fit),
        **meta,
    }
    write_json(report, summary)
    write_json(layers_report, {"format": fmt_name, "layers": layers})
    console.print(f"[green]fit-centroids[/] {fmt_name}: {len(layers)} matrices, "
                  f"{summary['bits_per_param']:.3f} bits/param, relative RMSE {summary['rel_rmse']:.4f}")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, help=f"one of {', '.join(formats.QUANTISED)}")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default=None, help="default: data/centroids/<format>.safetensors")
    parser.add_argument("--report", default=None, help="default: reports/centroids/<format>.json")
    args = parser.parse_args(argv)
    with stage_errors("fit-centroids"):
        if args.format not in formats.QUANTISED:
            raise ValueError(f"--format {args.format!r}: expected one of {', '.join(formats.QUANTISED)}")
        teacher = params.load(TeacherParams, "teacher", args.params)
        fit = params.load(FitParams, "fit", args.params)
        set_threads(fit.threads)
        fit_format(args.format, teacher, fit, args.out or f"data/centroids/{args.format}.safetensors",
                   args.report or f"reports/centroids/{args.format}.json",
                   f"reports/centroids/{args.format}_layers.json")


if __name__ == "__main__":
    main()
