"""Sampling the training prompts (SPEC section 5) over an image pool, into Parquet shards."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from pipeline.chat import is_text_only
from pipeline.teacher.images import image_refs
from pipeline.files.atomic import atomic_dir
from pipeline.models import load_processor
from pipeline.section import positive
from pipeline.teacher.prompts import SamplerParams, load_pool, render, sample
from pipeline.files.shards import write_shard
from pipeline.stage import versions
from pipeline.teacher.source import TeacherParams


@dataclass
class SampleParams:
    seed: int
    n_prompts: int = positive()
    shard_size: int = positive()
    images: str  # toy | folder:PATH | hf:DATASET[:SPLIT[:COLUMN]]
    pool: str
    sampler: SamplerParams


def sample_prompts(p: SampleParams, teacher: TeacherParams, out_dir: str | Path) -> dict:
    """Draw ``p.n_prompts`` prompts into shards of ``out_dir`` (replaced whole); returns statistics. A text-only
    teacher's prompts have no image (``image_ref`` null) and ``p.images`` is not read."""
    pool = load_pool(p.pool)
    processor = load_processor(teacher.dir)
    text_only = is_text_only(processor)
    refs = [None] * p.n_prompts if text_only else image_refs(p.images, p.n_prompts, p.seed)
    rows = []
    for i, ref in enumerate(refs):
        seed = p.seed * 1_000_003 + i
        drawn = sample(random.Random(seed), pool, p.sampler)
        rows.append({"index": i, "image_ref": ref, "prompt": render(drawn, processor),
                     "template": drawn.template, "user_text": drawn.user_text, "inner": drawn.inner,
                     "instruction": drawn.instruction, "length": drawn.length, "format": drawn.format,
                     "adherence": drawn.adherence, "seed": seed})
    meta = {"stage": "sample-prompts", "params": asdict(p), "teacher": teacher.source, **versions()}
    with atomic_dir(out_dir) as tmp:            # the directory appears whole, or not at all
        for start in range(0, len(rows), p.shard_size):
            write_shard(tmp / f"shard-{start // p.shard_size:05d}.parquet",
                        pa.Table.from_pylist(rows[start:start + p.shard_size]), meta)
    return {
        "prompts": len(rows),
        "shards": (len(rows) + p.shard_size - 1) // p.shard_size,
        "chat_fraction": sum(r["template"] == "chat" for r in rows) / len(rows),
        "instruction_fraction": sum(r["instruction"] is not None for r in rows) / len(rows),
        "distinct_user_texts": len({r["user_text"] for r in rows}),
    }
