"""The held-out evaluation of the toy teacher (stage ``toy-teacher-eval``): the four toy tasks with the real
images and with blank ones (the blind baseline: what the text alone gives away), and held-out generic requests
of the prompt pool's styles (the kind teacher-generate gives it)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from pipeline.eval.runner import evaluate, generate
from pipeline.stage import console, versions
from pipeline.toy.model import count_parameters
from pipeline.toy.settings import ToyTeacherParams
from pipeline.toy.tasks import DESCRIBE, TOY_TASKS, items, load_toy

# The quality bar of the teacher: every task at least 0.75, their average at least 0.80.
MIN_TASK, MIN_AVG = 0.75, 0.80


def generic_requests(model, processor, n: int, seed: int, batch_size: int) -> dict:
    """Greedy answers to ``n`` held-out generic requests: the share equal to the reference answer, the share
    equal to it but for letter case, and the latter for the requests that ask for capitals."""
    held_out = items(DESCRIBE, n, seed)
    answers = generate(model, processor, [it.image for it in held_out], [it.prompt for it in held_out],
                       max_new_tokens=96, batch_size=batch_size)
    exact = [a.strip() == it.response.strip() for a, it in zip(answers, held_out)]
    content = [a.strip().lower() == it.response.strip().lower() for a, it in zip(answers, held_out)]
    caps = [c for c, it in zip(content, held_out) if any(ch.isalpha() for ch in it.response) and it.response == it.response.upper()]
    return {"n": n, "exact": sum(exact) / n, "ignoring_case": sum(content) / n,
            "capitals_n": len(caps), "capitals_ignoring_case": sum(caps) / len(caps) if caps else None}


def markdown(summary: dict) -> str:
    s, b, g = summary["image"], summary["blank"], summary["generic"]
    lines = [
        "# Toy teacher: held-out evaluation",
        "",
        f"`{summary['teacher']}` ({summary['parameters']:,} parameters, bf16), {summary['n']} held-out items per task "
        f"(seed {summary['seed']}), greedy decoding, chat template. The blind baseline is the same model with every "
        "image replaced by a blank (white) one.",
        "",
        "| task | metric | teacher | blind baseline | gain |",
        "| --- | --- | --- | --- | --- |",
    ]
    metric = {"toy-vqa": "VQA accuracy", "toy-chartqa": "relaxed accuracy", "toy-docvqa": "ANLS", "toy-ai2d": "accuracy"}
    for task in s["scores"]:
        t, z = s["scores"][task], b["scores"][task]
        lines.append(f"| {task} | {metric.get(task, '')} | {t:.3f} | {z:.3f} | {t - z:+.3f} |")
    lines.append(f"| **average** | | **{s['avg']:.3f}** | {b['avg']:.3f} | {s['avg'] - b['avg']:+.3f} |")
    lines += [
        "",
        f"Quality bar: every task >= {MIN_TASK}, average >= {MIN_AVG}: **{'met' if summary['bar_met'] else 'NOT met'}**.",
        "",
        f"Generic requests of the prompt pool's styles ({g['n']} held-out, greedy): answered exactly as the reference "
        f"{g['exact']:.3f}, as it but for letter case {g['ignoring_case']:.3f}; of the {g['capitals_n']} asking for "
        "capitals, " + (f"{g['capitals_ignoring_case']:.3f} but for letter case." if g["capitals_n"] else "none drawn."),
        "",
        "Per-example answers: `reports/teacher_eval_examples.parquet`.",
        "",
    ]
    return "\n".join(lines)


def evaluate_teacher(p: ToyTeacherParams) -> tuple[dict, str, pa.Table, float]:
    """``(metrics, markdown report, per-example answers, seconds)`` of the teacher in ``p.out``."""
    teacher = Path(p.out)
    if not (teacher / "config.json").exists():
        raise FileNotFoundError(f"{teacher}: no trained teacher (run `dvc repro toy-teacher`)")
    processor = AutoProcessor.from_pretrained(teacher)
    model = AutoModelForImageTextToText.from_pretrained(teacher, dtype=torch.bfloat16)
    examples = {task: load_toy(task, p.eval.n, p.eval.seed) for task in TOY_TASKS}
    console.print(f"toy-teacher-eval: {teacher}, {p.eval.n} held-out items per task")
    results = {}
    for condition, blank in (("image", False), ("blank", True)):
        results[condition] = evaluate(model, processor, examples, batch_size=p.eval.batch_size, blank_image=blank, progress=True)
        console.print(f"  {condition}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[condition].scores.items())
                      + f", avg {results[condition].avg:.3f}")
    image = results["image"]
    generic = generic_requests(model, processor, p.eval.generic_n, p.eval.seed, p.eval.batch_size)
    console.print(f"  generic requests ({generic['n']}): exact {generic['exact']:.3f}, ignoring case "
                  f"{generic['ignoring_case']:.3f}; asking for capitals ({generic['capitals_n']}): {generic['capitals_ignoring_case']}")
    summary = {
        "parameters": count_parameters(model),
        "image": {"scores": image.scores, "avg": image.avg},
        "blank": {"scores": results["blank"].scores, "avg": results["blank"].avg},
        "generic": generic,
        "bar_met": min(image.scores.values()) >= MIN_TASK and image.avg >= MIN_AVG,
    }
    about = {"teacher": str(teacher), "n": p.eval.n, "seed": p.eval.seed, "decoding": image.meta["decoding"],
             "max_new_tokens": image.meta["max_new_tokens"], "versions": versions()}
    tables = [r.examples.append_column("condition", pa.array([c] * r.examples.num_rows, pa.string()))
              for c, r in results.items()]
    seconds = sum(sum(r.meta["seconds"].values()) for r in results.values())
    return summary, markdown({**summary, **about}), pa.concat_tables(tables), seconds
