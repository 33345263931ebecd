"""DVC stage teacher-generate: the bf16 teacher answers every sampled prompt (temperature 0.6, top-p 0.9).

    python stages/teacher_generate.py            # or: accelerate launch stages/teacher_generate.py

One output shard per input shard in ``data/teacher/``, each written atomically with a fingerprint of
its input, the parameters and the teacher; a re-run keeps the shards whose fingerprint matches, so a
killed run resumes where it stopped and ends with the same bytes. Shards are split across
``accelerate`` processes. Diversity metrics go to ``reports/teacher_generate.json``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import torch

from pipeline import params
from pipeline.diversity import diversity
from pipeline.images import load_image
from pipeline.io import write_json
from pipeline.models import dtype_of, load_model, load_processor
from pipeline.shards import file_hash, fingerprint, read_shard, shard_paths, write_shard
from pipeline.stage import console, progress, set_threads, stage_errors, versions
from pipeline.teacher import TeacherParams, local_dir

PROMPT_COLUMNS = ["index", "image_ref", "prompt", "template", "seed"]


@dataclass
class GenerateParams:
    seed: int = 0
    batch_size: int = 32
    max_new_tokens: int = 64
    temperature: float = 0.6
    top_p: float = 0.9
    threads: int | None = None


def teacher_identity(teacher: TeacherParams) -> dict:
    """What identifies the teacher's weights without hashing gigabytes: config hash and file sizes."""
    root = local_dir(teacher.source)
    files = sorted(root.glob("*.safetensors"))
    return {"source": teacher.source, "dtype": teacher.dtype, "config": file_hash(root / "config.json"),
            "weights": {f.name: f.stat().st_size for f in files},
            "weights_hash": file_hash(files[0]) if files and files[0].stat().st_size < (1 << 30) else None}


def eos_ids(model, processor) -> set[int]:
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    return {int(e) for e in eos if e is not None} | {processor.tokenizer.convert_tokens_to_ids("<|eot_id|>")}


@torch.inference_mode()
def generate_shard(model, processor, table: pa.Table, p: GenerateParams, shard_seed: int, on_batch=None) -> list[dict]:
    rows = table.to_pylist()
    stop = eos_ids(model, processor)
    pad = processor.tokenizer.pad_token_id
    out = []
    for b, start in enumerate(range(0, len(rows), p.batch_size)):
        batch = rows[start:start + p.batch_size]
        inputs = processor(images=[[load_image(r["image_ref"])] for r in batch], text=[r["prompt"] for r in batch],
                           add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        inputs = inputs.to(model.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        torch.manual_seed(shard_seed * 10_007 + b)
        generated = model.generate(**inputs, do_sample=True, temperature=p.temperature, top_p=p.top_p,
                                   max_new_tokens=p.max_new_tokens, pad_token_id=pad, eos_token_id=sorted(stop))
        prompt_len = inputs["input_ids"].shape[1]
        for r, ids, mask, gen in zip(batch, inputs["input_ids"], inputs["attention_mask"], generated[:, prompt_len:]):
            gen = gen.tolist()
            end = next((i + 1 for i, t in enumerate(gen) if t in stop), None)
            response = gen[:end] if end is not None else gen
            out.append({**r, "prompt_ids": ids[mask.bool()].tolist(), "response_ids": response,
                        "response_text": processor.tokenizer.decode(response, skip_special_tokens=True),
                        "finished": end is not None})
        if on_batch:
            on_batch(len(batch))
    return out


def run(p: GenerateParams, teacher: TeacherParams, in_dir: str, out_dir: str, report: str) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if p.batch_size < 1 or p.max_new_tokens < 1:
        raise ValueError(f"parameters generate.batch_size and generate.max_new_tokens must be positive")
    inputs = shard_paths(in_dir)
    ident = teacher_identity(teacher)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = []
    for i, path in enumerate(inputs):
        fp = fingerprint(file_hash(path), asdict(p) | {"threads": None}, ident)
        target = out / path.name
        done = False
        if target.exists():
            try:
                done = read_shard(target)[1].get("fingerprint") == fp
            except ValueError:
                done = False      # truncated or foreign: regenerate it
        plan.append((i, path, target, fp, done))
    todo = [x for x in plan if not x[4]][accelerator.process_index::accelerator.num_processes]
    if accelerator.is_main_process:
        console.print(f"teacher-generate: {len(plan) - len([x for x in plan if not x[4]])} of {len(plan)} shards "
                      f"already done; {len([x for x in plan if not x[4]])} to generate")
    if todo:
        model = load_model(teacher.source, dtype_of(teacher.dtype)).to(accelerator.device)
        processor = load_processor(teacher.source)
        total = sum(read_shard(path, PROMPT_COLUMNS)[0].num_rows for _, path, *_ in todo)
        with progress() as bar:
            task = bar.add_task("teacher answers", total=total)
            for i, path, target, fp, _ in todo:
                table, _ = read_shard(path, PROMPT_COLUMNS)
                rows = generate_shard(model, processor, table, p, p.seed * 100_003 + i,
                                      on_batch=lambda n: bar.advance(task, n))
                meta = {"stage": "teacher-generate", "fingerprint": fp, "params": asdict(p),
                        "teacher": ident, "input": path.name, **versions()}
                write_shard(target, pa.Table.from_pylist(rows), meta)
    accelerator.wait_for_everyone()
    for stale in set(out.glob("shard-*.parquet")) - {t for _, _, t, *_ in plan}:
        if accelerator.is_main_process:
            stale.unlink()
    stats = {}
    if accelerator.is_main_process:
        responses, finished = [], []
        for _, _, target, _, _ in plan:
            table, _ = read_shard(target, ["response_ids", "finished"])
            responses += table.column("response_ids").to_pylist()
            finished += table.column("finished").to_pylist()
        stats = diversity(responses, finished)
        stats["params"] = asdict(p)
        write_json(report, stats)
        console.print("[green]teacher-generate[/] " + json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                                                  for k, v in stats.items() if k != "params"}))
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--prompts", default="data/sampled")
    parser.add_argument("--out", default="data/teacher")
    parser.add_argument("--report", default="reports/teacher_generate.json")
    args = parser.parse_args(argv)
    with stage_errors("teacher-generate"):
        p = params.load(GenerateParams, "generate", args.params)
        teacher = params.load(TeacherParams, "teacher", args.params)
        set_threads(p.threads)
        run(p, teacher, args.prompts, args.out, args.report)


if __name__ == "__main__":
    main()
