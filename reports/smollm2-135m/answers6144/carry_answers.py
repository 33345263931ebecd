"""Carry /tmp/ao's first 12 answer shards into /tmp/ma's teacher-generate work directory under the fingerprints
teacher-generate computes here (same prompts, same per-shard seeds: the bytes it would write; only the input shard's
metadata, which records sample.n_prompts, differs)."""
from pathlib import Path
from pipeline import params
from pipeline.teacher import generate_answers as g
from pipeline.files.shards import read_shard, write_shard
import pyarrow.parquet as pq

doc = params.read("params.yaml")
jobs = g.plan(doc["generate"], doc["teacher"], "data/sampled", g.WORK_DIR)
g.WORK_DIR.mkdir(parents=True, exist_ok=True)
for j in jobs[:12]:
    table, meta = read_shard(Path("/tmp/ao/checkpoints/teacher-generate") / j.target.name)
    meta = meta | {"fingerprint": j.fingerprint, "carried_from": "/tmp/ao (n_prompts 3072)"}
    write_shard(j.target, table, meta)
print([g.plan(doc["generate"], doc["teacher"], "data/sampled", g.WORK_DIR)[i].done for i in range(24)])
