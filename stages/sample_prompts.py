"""DVC stage sample-prompts: draw the training prompts (SPEC section 5) over an image pool.

    python stages/sample_prompts.py

Writes Parquet shards ``data/sampled/shard-NNNNN.parquet``: image reference, the rendered
prompt, its template kind, inner prompt and instruction parts, and the per-prompt seed.
"""

from __future__ import annotations

import argparse

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
import pipeline.toy  # noqa: F401  (the `toy` image pool)
from pipeline import params
from pipeline.files.atomic import write_json
from pipeline.teacher.sample import SampleParams, sample_prompts
from pipeline.stage import console, stage_errors
from pipeline.teacher.source import TeacherParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="data/sampled")
    parser.add_argument("--report", default="reports/sample_prompts.json")
    args = parser.parse_args(argv)
    with stage_errors("sample-prompts"):
        p = params.load(SampleParams, "sample", args.params)
        teacher = params.load(TeacherParams, "teacher", args.params)
        stats = sample_prompts(p, teacher, args.out)
        write_json(args.report, stats)
        console.print(f"[green]sample-prompts[/] {stats['prompts']} prompts in {stats['shards']} shards; "
                      f"chat {stats['chat_fraction']:.2f}, instruction block {stats['instruction_fraction']:.2f}, "
                      f"{stats['distinct_user_texts']} distinct texts")


if __name__ == "__main__":
    main()
