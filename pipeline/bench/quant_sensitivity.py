"""How far a teacher is from collapsing under a weight format: task scores with k times its quantisation error.

Every module the recipe quantises gets ``w + k * (quantize(w) - w)`` (a fresh fit per matrix, as in
fit-centroids): k = 1 is the direct cast (bf16 activations), k = 0 the teacher, k > 1 shows how much margin
is left before the scores fall. On the paper's 11B model direct cast to S3D8 scores about 0; a toy teacher
whose scores fall only at k = 2-3 cannot show what QAT recovers in its scores. Usage:

    .venv/bin/python -m pipeline.bench.quant_sensitivity [--teacher data/toy-teacher] [--formats s3d8 int]
        [--scales 0 0.5 1 1.5 2] [--n 128] [--out reports/quant_sensitivity.json]
"""

from __future__ import annotations

import argparse
import time

import torch

from pipeline import formats
from pipeline.eval.runner import evaluate
from pipeline.toy.tasks import load_toy
from pipeline.files.atomic import write_json
from pipeline.models import load_model, load_processor, quantised_weight_names
from pipeline.stage import console, set_threads, versions
from pipeline.toy.tasks import TOY_TASKS


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.quant_sensitivity", description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default="data/toy-teacher", help="model directory (or hub id)")
    parser.add_argument("--formats", nargs="+", default=[formats.SUBJECT, "int"], choices=formats.QUANTISED)
    parser.add_argument("--scales", nargs="+", type=float, default=[0.0, 0.5, 1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--n", type=int, default=128, help="held-out items per toy task")
    parser.add_argument("--seed", type=int, default=0, help="fit and item seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    set_threads(args.threads)

    model = load_model(args.teacher, torch.float32)
    processor = load_processor(args.teacher)
    examples = {task: load_toy(task, args.n, seed=args.seed) for task in TOY_TASKS}
    modules = dict(model.named_modules())
    weights = {name: modules[name].weight for name in quantised_weight_names(model)}
    original = {name: w.detach().clone() for name, w in weights.items()}

    rows = []
    for fmt_name in args.formats:
        fmt = formats.get(fmt_name)
        t0 = time.perf_counter()
        error = {name: fmt.quantize(w, fmt.fit(w, seed=args.seed)) - w for name, w in original.items()}
        # all-zero rows (an embedding's pad row) decode to table values under SPEC's scale-1 rule:
        # they are applied, but left out of the summary error, as fit-centroids does
        kept = {name: w.abs().amax(dim=1) > 0 for name, w in original.items()}
        energy = sum(w[kept[name]].pow(2).sum().item() for name, w in original.items())
        rel_rmse = (sum(e[kept[name]].pow(2).sum().item() for name, e in error.items()) / energy) ** 0.5
        console.print(f"{fmt_name}: fitted {len(error)} matrices in {time.perf_counter() - t0:.1f} s, "
                      f"relative RMSE {rel_rmse:.4f} (all-zero rows apart)")
        for k in args.scales:
            with torch.no_grad():
                for name, w in weights.items():
                    w.copy_(original[name] + k * error[name])
            result = evaluate(model, processor, examples, batch_size=64)
            rows.append({"format": fmt_name, "k": k, "rel_rmse": k * rel_rmse,
                         "scores": result.scores, "avg": result.avg})
            console.print(f"  k={k:<4g} avg {result.avg:.3f}  "
                          + "  ".join(f"{t} {v:.3f}" for t, v in result.scores.items()), soft_wrap=True)
    if args.out:
        write_json(args.out, {"teacher": args.teacher, "n": args.n, "seed": args.seed, "rows": rows,
                              "versions": versions()})


if __name__ == "__main__":
    main()
