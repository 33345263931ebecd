"""The evaluation summary: the paper's table with our numbers beside the published ones, and a plot."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from pipeline import formats
from pipeline.texts import corpus_info
from pipeline.files.atomic import atomic_dir, atomic_path, write_json, write_text

# SPEC section 6: Llama 3.2 11B Vision Instruct, published.
PUBLISHED = [
    ("bfloat16", 21340, 16.00, 0.744),
    ("S3D8 + QAT", 3569, 2.68, 0.661),
    ("INT + QAT", 3620, 2.71, 0.347),
    ("student-t + QAT", 3620, 2.71, 0.565),
    ("lloyd-max + QAT", 3459, 2.59, 0.436),
]
ORDER = [formats.BF16_BASELINE, *formats.QUANTISED]
NOISE = 0.01  # score differences below this are not read as a loss or a gain


def _sort_key(item):
    name, m = item
    return (ORDER.index(m["format"]) if m["format"] in ORDER else 99, {"teacher": 0, "qat": 1, "direct-cast": 2}[m["method"]])


def summary_markdown(result: dict, tasks: list[str], baselines: dict, teacher_name: str) -> str:
    models = result["models"]
    teacher = next((m for m in models.values() if m["method"] == "teacher"), None)
    lines = [f"# Evaluation: {teacher_name} and its quantised students", "",
             "Scores on held-out slices of each task (greedy decoding, chat template); quantised models are "
             "loaded from their packed files and run with per-token INT8 activations. KL is "
             "KL(teacher || model) per response token on held-out teacher answers. "
             "Every number here was measured by `dvc repro` in this run.", ""]
    head = ["model", "format", "method", "size (MB)", "bpp", *tasks, "avg", "Δ avg vs teacher", "KL"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, m in sorted(models.items(), key=_sort_key):
        delta = m["avg"] - teacher["avg"] if teacher else float("nan")
        row = [name, m["format"], m["method"], f"{m['size_mb']:.2f}", f"{m['bpp']:.2f}",
               *[f"{m['scores'][t]:.3f}" for t in tasks], f"**{m['avg']:.3f}**",
               "—" if m["method"] == "teacher" else f"{delta:+.3f}", f"{m['kl']:.4f}"]
        lines.append("| " + " | ".join(row) + " |")
    for name, b in baselines.items():
        lines.append(f"| {name} (blank image) | bf16 | baseline | | | " + " | ".join(f"{b['scores'][t]:.3f}" for t in tasks)
                     + f" | {b['avg']:.3f} | {b['avg'] - teacher['avg']:+.3f} | |")
    lines += ["", "## What QAT recovers", "",
              f"Score differences under {NOISE} (a few held-out items) are read as noise, not as a loss. "
              "KL to the teacher measures the damage below that resolution.", "",
              "| format | direct cast avg | QAT avg | score recovered | QAT Δ avg vs teacher | direct cast KL | QAT KL "
              "| KL removed by QAT |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for fmt in ORDER[1:]:
        dc = next((m for m in models.values() if m["format"] == fmt and m["method"] == "direct-cast"), None)
        qat = next((m for m in models.values() if m["format"] == fmt and m["method"] == "qat"), None)
        if dc and qat and teacher:
            lost = teacher["avg"] - dc["avg"]
            share = f"{(qat['avg'] - dc['avg']) / lost:.0%} of the loss" if lost >= NOISE else "no loss to recover"
            removed = f"{1 - qat['kl'] / dc['kl']:.0%}" if dc["kl"] > 0 else "—"
            lines.append(f"| {fmt} | {dc['avg']:.3f} | {qat['avg']:.3f} | {share} | {qat['avg'] - teacher['avg']:+.3f} "
                         f"| {dc['kl']:.4f} | {qat['kl']:.4f} | {removed} |")
    qat_models = [m for m in models.values() if m["method"] == "qat"]
    if qat_models:
        lines += ["", "Order of the formats after QAT (this run), by average score: " +
                  " > ".join(f"{m['format']} ({m['avg']:.3f})" for m in sorted(qat_models, key=lambda m: -m["avg"]))
                  + "; by KL to the teacher (lower is closer): " +
                  " < ".join(f"{m['format']} ({m['kl']:.4f})" for m in sorted(qat_models, key=lambda m: m["kl"])) + ".", ""]
    lines += ["## Published (Llama 3.2 11B Vision Instruct, SPEC section 6)", "",
              "| format | size (MB) | bpp | avg |", "| --- | --- | --- | --- |"]
    lines += [f"| {n} | {s:,} | {b:.2f} | {a:.3f} |" for n, s, b, a in PUBLISHED]
    lines += ["", "Published order after QAT: S3D8 > student-t > lloyd-max > INT; S3D8 loses 0.083 to bf16.", ""]
    return "\n".join(lines)


def scores_csv(result: dict, tasks: list[str]) -> str:
    """One row per (model, task) and the average, for ``dvc plots`` (a bar chart that compares experiments)."""
    lines = ["model,format,method,task,score"]
    for name, m in sorted(result["models"].items(), key=_sort_key):
        for task in [*tasks, "avg"]:
            value = m["avg"] if task == "avg" else m["scores"][task]
            lines.append(f"{name},{m['format']},{m['method']},{task},{value:.6f}")
    return "\n".join(lines) + "\n"


def text_summary_markdown(result: dict, teacher_name: str, corpus: dict, samples: dict) -> str:
    """A text-only teacher's evaluation: KL, top-1 agreement and perplexity per model, the corpus named, and
    each model's greedy answer to the first held-out prompt (``samples``: name -> (prompt, response))."""
    models = result["models"]
    lines = [f"# Evaluation: {teacher_name} and its quantised students", "",
             "KL(teacher || model) per response token and top-1 agreement (the model's most likely next token is "
             "the teacher's) on held-out teacher answers; perplexity on the held-out prose of "
             f"{corpus['source']} (Python {corpus['python']}, {corpus['chars']:,} characters, sha256 "
             f"{corpus['sha256'][:12]}…; {corpus['heldout_rule']}). Quantised models are loaded from their packed "
             "files and run with per-token INT8 activations. Every number here was measured by `dvc repro` in "
             "this run.", "",
             "| model | format | method | size (MB) | bpp | KL | top-1 agreement | perplexity |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in sorted(models.items(), key=_sort_key):
        lines.append(f"| {name} | {m['format']} | {m['method']} | {m['size_mb']:.2f} | {m['bpp']:.2f} | "
                     f"{m['kl']:.4f} | {m['top1_agreement']:.3f} | {m['perplexity']:.2f} |")
    lines += ["", "## Generation samples (greedy, the first held-out prompt)", ""]
    for name, (prompt, response) in samples.items():
        lines += [f"**{name}**: {' '.join(response.split())}", ""]
    if samples:
        lines += ["Prompt: `" + " ".join(next(iter(samples.values()))[0].split()) + "`", ""]
    return "\n".join(lines)


def text_scores_csv(result: dict) -> str:
    """:func:`scores_csv`'s columns for a text-only teacher: one row per (model, metric)."""
    lines = ["model,format,method,task,score"]
    for name, m in sorted(result["models"].items(), key=_sort_key):
        for metric in ("kl", "top1_agreement", "perplexity"):
            lines.append(f"{name},{m['format']},{m['method']},{metric},{m[metric]:.6f}")
    return "\n".join(lines) + "\n"


def plot_scores(result: dict, path: str | Path, key: str = "avg", ylabel: str = "average score (held-out items)",
                title: str = "Average score per format: direct cast vs QAT") -> None:
    """``key`` (the average score) per format, direct cast beside QAT, the teacher as a line; the axis starts just
    below the lowest model, so the differences between formats are visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    teacher = next((m for m in models.values() if m["method"] == "teacher"), None)
    fmts = [f for f in formats.QUANTISED if any(m["format"] == f for m in models.values())]
    fig, ax = plt.subplots(figsize=(8.5, 4), dpi=120)
    width = 0.38
    for offset, method, color in ((-width / 2, "direct-cast", "#c9c9c9"), (width / 2, "qat", "#3b75af")):
        xs, ys = [], []
        for i, f in enumerate(fmts):
            m = next((m for m in models.values() if m["format"] == f and m["method"] == method), None)
            if m:
                xs.append(i + offset)
                ys.append(m[key])
        bars = ax.bar(xs, ys, width, label=method, color=color, edgecolor="black", linewidth=0.5)
        ax.bar_label(bars, fmt="%.3f", fontsize=7, padding=2)
    values = [m[key] for m in models.values()]
    low = max(0.0, min(values) - 0.05)
    if teacher:
        ax.axhline(teacher[key], color="black", linestyle="--", linewidth=1,
                   label=f"bf16 teacher ({teacher[key]:.3f})")
    ax.set_xticks(range(len(fmts)), [f"{formats.get(f).label}\n{models.get(f'{f}-qat', {}).get('bpp', 0):.2f} bpp"
                                     for f in fmts])
    ax.set_ylim(low, min(1.0, max(values) + 0.04))
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def write_reports(result: dict, baselines: dict, answers: dict, tasks: list[str], teacher_name: str) -> None:
    """Stage eval's outputs: ``reports/eval.json``, ``eval_baselines.json``, the per-model answers
    (``reports/answers/<model>.parquet``), ``eval_scores.csv``, ``summary.md`` and ``eval_plot.png`` (a text-only
    teacher's: KL, top-1 agreement and perplexity, with a generation sample per model)."""
    with atomic_dir("reports/answers") as out:
        for name, table in answers.items():
            pq.write_table(table, out / f"{name}.parquet")
    write_json("reports/eval.json", result)
    write_json("reports/eval_baselines.json", {"blind": baselines})
    if any("perplexity" in m for m in result["models"].values()):      # a text-only teacher
        samples = {name: (t.column("prompt")[0].as_py(), t.column("response")[0].as_py())
                   for name, t in answers.items()}
        write_text("reports/eval_scores.csv", text_scores_csv(result))
        write_text("reports/summary.md", text_summary_markdown(result, teacher_name, corpus_info(), samples))
        plot_scores(result, "reports/eval_plot.png", key="top1_agreement",
                    ylabel="top-1 agreement with the teacher", title="Top-1 agreement: direct cast vs QAT")
    else:
        write_text("reports/eval_scores.csv", scores_csv(result, tasks))
        write_text("reports/summary.md", summary_markdown(result, tasks, baselines, teacher_name))
        plot_scores(result, "reports/eval_plot.png")
