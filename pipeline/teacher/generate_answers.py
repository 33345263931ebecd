"""Teacher generation: the teacher answers every sampled prompt (SPEC section 5: temperature 0.6, top-p 0.9),
one output shard per input shard, resumable.

Each finished shard is written (atomically) to a work directory outside the DVC output,
``checkpoints/teacher-generate/``, with a fingerprint of its input, the parameters and the teacher; a rerun
keeps every shard whose fingerprint matches, so a killed run resumes where it stopped. When all are done
the output directory is assembled whole from them: it never holds a partial or stray file, and DVC's run
cache can restore it like any other output. Pending shards are dealt to the processes under ``accelerate``; a
process without one (or done with its own) hands over and leaves, and rank 0 assembles the output once every
process has (``pipeline.launch.ranks.collect``: no rank waits in a collective while another generates).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.chat import is_text_only, tokenizer_of
from pipeline.teacher.diversity import diversity
from pipeline.teacher.images import load_image
from pipeline.launch import ranks
from pipeline.files.atomic import atomic_dir
from pipeline.launch.processes import settings as launch_settings
from pipeline.models import dtype_of, load_model, load_processor
from pipeline.section import bounded, non_negative, positive
from pipeline.runtime.generation import eos_ids
from pipeline.files.shards import file_hash, fingerprint, read_shard, shard_paths, write_shard
from pipeline.stage import console, progress, versions
from pipeline.teacher.source import TeacherParams, local_dir

PROMPT_COLUMNS = ["index", "image_ref", "prompt", "template", "seed"]
WORK_DIR = Path("checkpoints/teacher-generate")


@dataclass
class GenerateParams:
    seed: int
    batch_size: int = positive()
    max_new_tokens: int = positive()
    temperature: float = non_negative()
    top_p: float = bounded(gt=0, le=1)
    threads: int = non_negative()


def teacher_identity(teacher: TeacherParams) -> dict:
    """What identifies the teacher's weights without hashing gigabytes: config hash and file sizes."""
    root = local_dir(teacher.dir)
    files = sorted(root.glob("*.safetensors"))
    return {"source": teacher.source, "dtype": teacher.dtype, "config": file_hash(root / "config.json"),
            "weights": {f.name: f.stat().st_size for f in files},
            "weights_hash": file_hash(files[0]) if files and files[0].stat().st_size < (1 << 30) else None}


@torch.inference_mode()
def generate_shard(model, processor, table: pa.Table, p: GenerateParams, shard_seed: int, on_batch=None,
                   pool: str | None = None) -> list[dict]:
    """The teacher's answers to one shard of prompts (sampled, seeded per batch); with ``pool`` (the
    ``sample.images`` spec) every image reference must lie inside that pool."""
    rows = table.to_pylist()
    stop = eos_ids(model, processor)
    tokenizer = tokenizer_of(processor)
    pad = tokenizer.pad_token_id
    out = []
    for b, start in enumerate(range(0, len(rows), p.batch_size)):
        batch = rows[start:start + p.batch_size]
        text = [r["prompt"] for r in batch]
        if is_text_only(processor):
            inputs = tokenizer(text, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        else:
            inputs = processor(images=[[load_image(r["image_ref"], pool)] for r in batch], text=text,
                               add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        inputs = inputs.to(model.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        torch.manual_seed(shard_seed * 10_007 + b)
        sampling = {"do_sample": True, "temperature": p.temperature, "top_p": p.top_p} if p.temperature > 0 \
            else {"do_sample": False}
        generated = model.generate(**inputs, **sampling, max_new_tokens=p.max_new_tokens, pad_token_id=pad,
                                   eos_token_id=sorted(stop))
        prompt_len = inputs["input_ids"].shape[1]
        for r, ids, mask, gen in zip(batch, inputs["input_ids"], inputs["attention_mask"], generated[:, prompt_len:]):
            gen = gen.tolist()
            end = next((i + 1 for i, t in enumerate(gen) if t in stop), None)
            response = gen[:end] if end is not None else gen
            out.append({**r, "prompt_ids": ids[mask.bool()].tolist(), "response_ids": response,
                        "response_text": tokenizer.decode(response, skip_special_tokens=True),
                        "finished": end is not None})
        if on_batch:
            on_batch(len(batch))
    return out


@dataclass(frozen=True)
class ShardJob:
    index: int
    source: Path          # the sampled prompts
    target: Path          # the finished answers, in the work directory
    fingerprint: str
    done: bool


def plan(p: GenerateParams, teacher: TeacherParams, in_dir: str | Path, work: Path) -> list[ShardJob]:
    """One job per input shard; ``done`` when the work directory holds its answers with the same fingerprint."""
    ident = teacher_identity(teacher)
    jobs = []
    for i, path in enumerate(shard_paths(in_dir)):
        table, _ = read_shard(path, PROMPT_COLUMNS)
        if table.num_rows == 0:
            raise ValueError(f"{path}: shard holds no prompts")
        fp = fingerprint(file_hash(path), asdict(p) | {"threads": None}, ident)
        target = work / path.name
        done = False
        if target.exists():
            try:
                done = read_shard(target)[1].get("fingerprint") == fp
            except ValueError:
                done = False      # truncated or foreign: regenerate it
        jobs.append(ShardJob(i, path, target, fp, done))
    return jobs


def run(p: GenerateParams, teacher: TeacherParams, in_dir: str | Path, out_dir: str | Path,
        work: Path = WORK_DIR, pool: str | None = None) -> dict:
    """Answer every prompt shard of ``in_dir`` into ``out_dir``; returns the answers' diversity statistics."""
    from accelerate import Accelerator

    ranks.init_process_group(launch_settings())
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    work.mkdir(parents=True, exist_ok=True)
    jobs = plan(p, teacher, in_dir, work)
    pending = [j for j in jobs if not j.done]
    mine = pending[accelerator.process_index::accelerator.num_processes]
    if accelerator.is_main_process:
        console.print(f"teacher-generate: {len(jobs) - len(pending)} of {len(jobs)} shards already done; "
                      f"{len(pending)} to generate")
    if mine:
        device = accelerator.device
        model = load_model(teacher.dir, dtype_of(teacher.dtype)).to(device)
        processor = load_processor(teacher.dir)
        total = sum(read_shard(j.source, PROMPT_COLUMNS)[0].num_rows for j in mine)
        with progress() as bar:
            task = bar.add_task("teacher answers", total=total)
            for j in mine:
                table, _ = read_shard(j.source, PROMPT_COLUMNS)
                rows = generate_shard(model, processor, table, p, p.seed * 100_003 + j.index,
                                      on_batch=lambda n: bar.advance(task, n), pool=pool)
                meta = {"stage": "teacher-generate", "fingerprint": j.fingerprint, "params": asdict(p),
                        "teacher": teacher_identity(teacher), "input": j.source.name, **versions()}
                write_shard(j.target, pa.Table.from_pylist(rows), meta)
    if ranks.collect("teacher-generate", None) is None:
        return {}                                  # rank 0 assembles
    with atomic_dir(out_dir) as tmp:
        for j in jobs:
            shutil.copyfile(j.target, tmp / j.target.name)
    for stale in set(work.glob("shard-*.parquet")) - {j.target for j in jobs}:
        stale.unlink()
    responses, finished = [], []
    for j in jobs:
        table, _ = read_shard(j.target, ["response_ids", "finished"])
        responses += table.column("response_ids").to_pylist()
        finished += table.column("finished").to_pylist()
    return diversity(responses, finished)
