"""The evaluation summary: the paper's table with our numbers beside the published ones, and a plot."""

from __future__ import annotations

from pathlib import Path

from pipeline.io import atomic_path

# SPEC section 6: Llama 3.2 11B Vision Instruct, published.
PUBLISHED = [
    ("bfloat16", 21340, 16.00, 0.744),
    ("S3D8 + QAT", 3569, 2.68, 0.661),
    ("INT + QAT", 3620, 2.71, 0.347),
    ("student-t + QAT", 3620, 2.71, 0.565),
    ("lloyd-max + QAT", 3459, 2.59, 0.436),
]
ORDER = ["bf16", "s3d8", "int", "student_t", "lloyd_max"]
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


def plot_scores(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    markers = {"teacher": "*", "qat": "o", "direct-cast": "x"}
    for name, m in sorted(result["models"].items(), key=_sort_key):
        ax.scatter(m["bpp"], m["avg"], marker=markers[m["method"]], s=80 if m["method"] != "direct-cast" else 50,
                   label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bits per parameter (nominal)")
    ax.set_ylabel("average score")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Score vs bits per parameter")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
