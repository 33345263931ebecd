"""A tiny teacher and a scratch working directory for running the stage scripts as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def build_tiny_teacher(path: Path) -> Path:
    """An untrained, very small toy-world Mllama with the toy processor, saved in bf16."""
    import torch
    from transformers import GenerationConfig

    from pipeline.params import defaults
    from pipeline.toy.model import ModelSize, build_model, tiny_config
    from pipeline.toy.processor import build_processor, text_vocab_size
    from pipeline.toy.tasks import text_corpus

    processor = build_processor(text_corpus(20))
    size = defaults(ModelSize, "toy_teacher.model", vision_hidden=32, vision_layers=2, vision_global_layers=1,
                    vision_heads=2, vision_intermediate=64, vision_intermediate_layers=[0, 1], text_hidden=64,
                    text_layers=3, cross_attention_layers=[1], text_heads=2, text_kv_heads=1, text_intermediate=128)
    model = build_model(tiny_config(size, text_vocab_size(processor)), seed=0).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[1, 8, 9], pad_token_id=4, bos_token_id=0)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def tiny_params(teacher: Path, **overrides) -> dict:
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    doc["teacher"]["source"] = doc["teacher"]["dir"] = str(teacher)     # teacher-import is not run here
    doc["formats"] = ["s3d8"]
    doc["heldout_prompts"] = 4
    doc["fit"]["threads"] = 1
    doc["sample"].update(n_prompts=24, shard_size=8)
    doc["generate"].update(batch_size=8, max_new_tokens=6, threads=1)
    doc["qat"].update(steps=4, batch_size=4, checkpoint_every=2, max_seq_len=96, threads=1, lr=1e-3)
    doc["eval"].update(n=4, batch_size=8, kl_batch_size=4, max_seq_len=96, threads=1, blind_baseline=False)
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if name:
            doc[section][name] = value
        else:
            doc[section] = value
    return doc


def workdir(path: Path, teacher: Path, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "data" / "prompts").mkdir(parents=True, exist_ok=True)
    pool = path / "data" / "prompts" / "prompt_pool.yaml"
    if not pool.exists():
        pool.symlink_to(REPO / "data" / "prompts" / "prompt_pool.yaml")
    (path / "params.yaml").write_text(yaml.safe_dump(tiny_params(teacher, **overrides)))
    return path


def _env() -> dict:
    # PYTHONPATH: the stage scripts import this checkout's package, whatever an editable install points at.
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "PYTHONPATH": str(REPO)}


def run_stage(cwd: Path, script: str, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a stage script in ``cwd``; ``env`` adds to the environment (another CPU's code path, for one)."""
    proc = subprocess.run([sys.executable, str(REPO / "stages" / script), *args], cwd=cwd, env=_env() | (env or {}),
                          capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


_KILL_AFTER = """
import importlib, os, runpy, signal, sys
target, calls = sys.argv[1], int(sys.argv[2])
module, _, attr = target.partition(":")
if not attr:
    module, attr = module.rsplit(".", 1)
owner = importlib.import_module(module)
*path, name = attr.split(".")
for part in path:
    owner = getattr(owner, part)
original = getattr(owner, name)
count = [0]
def then_die(*args, **kwargs):
    original(*args, **kwargs)
    count[0] += 1
    if count[0] == calls:
        os.kill(os.getpid(), signal.SIGKILL)
setattr(owner, name, then_die)
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_stage_killed_after(cwd: Path, function: str, script: str, *args: str, calls: int = 1) -> subprocess.CompletedProcess:
    """Run a stage that is killed (SIGKILL) right after its ``calls``-th call of ``function`` returns (a dotted
    name such as ``pipeline.files.shards.write_shard``, or ``module:Class.method`` such as
    ``pipeline.packed.safetensors_io:StreamingWriter.write``, a kill in the middle of writing a file): a crash at a known
    point, whatever the speed of the machine."""
    proc = subprocess.run([sys.executable, "-c", _KILL_AFTER, function, str(calls), str(REPO / "stages" / script), *args],
                          cwd=cwd, env=_env(), capture_output=True, text=True)
    if proc.returncode != -9:
        raise AssertionError(f"{script} was not killed after {function} ({proc.returncode}):\n{proc.stderr}")
    return proc
