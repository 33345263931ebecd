"""DVC stage sample-prompts: draw the training prompts (SPEC section 5) over an image pool.

    python stages/sample_prompts.py

Writes Parquet shards ``data/sampled/shard-NNNNN.parquet``: image reference, the rendered
prompt, its template kind, inner prompt and instruction parts, and the per-prompt seed.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from pipeline import params
from pipeline.images import image_refs
from pipeline.io import write_json
from pipeline.models import load_processor
from pipeline.prompts import SamplerParams, load_pool, render, sample
from pipeline.shards import write_shard
from pipeline.stage import console, stage_errors, versions
from pipeline.teacher import TeacherParams


@dataclass
class SampleParams:
    seed: int = 0
    n_prompts: int = 2048
    shard_size: int = 512
    images: str = "toy"
    pool: str = "data/prompts/prompt_pool.yaml"
    sampler: SamplerParams = field(default_factory=SamplerParams)


def sample_prompts(p: SampleParams, teacher: TeacherParams, out_dir: str) -> dict:
    if p.n_prompts < 1 or p.shard_size < 1:
        raise ValueError(f"parameters sample.n_prompts and sample.shard_size must be positive, "
                         f"got {p.n_prompts} and {p.shard_size}")
    pool = load_pool(p.pool)
    processor = load_processor(teacher.source)
    refs = image_refs(p.images, p.n_prompts, p.seed)
    rows = []
    for i, ref in enumerate(refs):
        seed = p.seed * 1_000_003 + i
        drawn = sample(random.Random(seed), pool, p.sampler)
        rows.append({"index": i, "image_ref": ref, "prompt": render(drawn, processor),
                     "template": drawn.template, "user_text": drawn.user_text, "inner": drawn.inner,
                     "instruction": drawn.instruction, "length": drawn.length, "format": drawn.format,
                     "adherence": drawn.adherence, "seed": seed})
    meta = {"stage": "sample-prompts", "params": asdict(p), "teacher": teacher.source, **versions()}
    out = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if out.parent.exists() else None))
    try:
        for start in range(0, len(rows), p.shard_size):
            shard = pa.Table.from_pylist(rows[start:start + p.shard_size])
            write_shard(tmp / f"shard-{start // p.shard_size:05d}.parquet", shard, meta)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)           # the directory appears whole, or not at all
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    stats = {
        "prompts": len(rows),
        "shards": (len(rows) + p.shard_size - 1) // p.shard_size,
        "chat_fraction": sum(r["template"] == "chat" for r in rows) / len(rows),
        "instruction_fraction": sum(r["instruction"] is not None for r in rows) / len(rows),
        "distinct_user_texts": len({r["user_text"] for r in rows}),
        "images": p.images,
    }
    console.print(f"[green]sample-prompts[/] {stats['prompts']} prompts in {stats['shards']} shards; "
                  f"chat {stats['chat_fraction']:.2f}, instruction block {stats['instruction_fraction']:.2f}, "
                  f"{stats['distinct_user_texts']} distinct texts")
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="data/sampled")
    parser.add_argument("--report", default="reports/sample_prompts.json")
    args = parser.parse_args(argv)
    with stage_errors("sample-prompts"):
        p = params.load(SampleParams, "sample", args.params)
        teacher = params.load(TeacherParams, "teacher", args.params)
        write_json(args.report, sample_prompts(p, teacher, args.out))


if __name__ == "__main__":
    main()
