"""End-to-end generation benchmark: tokens/s of packed models on the native kernels.

``python -m pipeline.bench.generate [--models toy,synthetic-1b] [--threads 1,2] [--prompt-tokens 128]
[--new-tokens 64] [--impls lean,hf] [--llama-cpp]`` writes ``reports/bench_generate.json`` (``{"records": [{model,
format, impl, threads, prompt_tokens, new_tokens, prefill_tokens_per_s, decode_tokens_per_s, overhead_ms_per_token,
weight_bytes, peak_rss_mb, ...}], "machine": {cpu, flags, ...}, "read_bandwidth_gb_s_by_threads": {...}, ...}``),
``reports/bench_generate.md`` (with the goals) and ``reports/bench_generate.png``.

Every row runs in a fresh subprocess (``--child``), so its peak RSS (``ru_maxrss``) is that model's
alone. The prompt is 128 seeded random token ids, generation greedy with EOS ignored, after a warm-up
with another prompt of the same length (2 new tokens; its seconds are ``warmup_s``): the native INT8
products above 16 tokens tune their path on the first call of each size class (``native.TUNE``, which
times torch's INT8 GEMM too, slow without VNNI), a one-off cost a timed prefill must not hold. Synthetic models
(``pipeline.synthetic``) are written on first use under ``models/synthetic/``; the toy is the committed teacher packed
to each ``--formats`` entry with a packed layout. llama.cpp rows (``--llama-cpp``) need requirements-bench.txt:
the bf16 synthetic weights as GGUF, quantised by llama.cpp's own ``llama_model_quantize``; without
the packages those rows are skipped with a message. Read bandwidth is measured for each thread count with
``native.read_bandwidth_probe`` (1 GiB split over the threads, best of 5, on memory allocated as the runtime's
weights are: huge pages advised); a row's bandwidth bound is its thread count's. ``overhead_ms_per_token`` (lean rows): a decode token of the C step with its weight products stubbed out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from pipeline import formats
from pipeline.bench import machine, vision
from pipeline.formats import BF16_BASELINE, INT8_BASELINE, SUBJECT
from pipeline.files.atomic import atomic_path, write_json, write_text

ROOT = Path(__file__).resolve().parents[2]
SYNTH_DIR = ROOT / "models" / "synthetic"
# llama.cpp's types by its ftype names. llama.cpp keeps the token embedding (which the tied models also use as
# their output head) at 6 bits in its low-bit types, which puts a 1B's Q2_K file at 3.7 bits per weight;
# "X+embd:Y" is type X with the token embedding at Y (llama-quantize's --token-embedding-type), so that the whole
# file is near X's bits, as S3D8's is. The i-quants below 3 bits need an importance matrix, which
# llama-cpp-python cannot make (llama.cpp's imatrix tool is not in it), so IQ3_S is the lowest one here.
LLAMA_CPP_TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q3_K_S", "Q2_K", "Q2_K+embd:Q2_K", "IQ3_S+embd:IQ3_S")
GOALS = {"s3d8_vs_int8": 2.0, "s3d8_vs_bf16": 4.0, "s3d8_vs_llama_cpp_le_3_5_bits": 1.3,
         "bandwidth_fraction": 0.8, "rss_factor": 1.2, "rss_slack_mb": 300, "toy_tokens_per_s_1_thread": 1000}


# --- model files ------------------------------------------------------------------------------------------------

def toy_packed(fmt_name: str = SUBJECT) -> Path:
    """The committed toy teacher packed to ``fmt_name`` (any format with a packed layout; each matrix with its own
    fitted state), built once under ``models/synthetic/toy/``."""
    fmt = formats.packed(fmt_name, "--formats")
    path = SYNTH_DIR / "toy" / f"{fmt.name}.safetensors"
    if path.exists():
        return path
    from pipeline.models import load_config, meta_model, quantised_weight_names
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.packed.file import write_packed

    src = ROOT / "data" / "toy-teacher"
    reader = CheckpointReader(src / "model.safetensors")
    names = quantised_weight_names(meta_model(load_config(str(src))))
    states = {s.removesuffix(".weight"): fmt.fit(reader.get(s).float()) for s in names.values()}
    write_packed(path, reader, fmt, states, dtype=torch.bfloat16,
                 metadata={"config": load_config(str(src)).to_dict(), "source_model": str(src)})
    return path


def model_file(model: str, fmt: str) -> Path:
    from pipeline.synthetic.vision import PRESETS as VISION, write_vision

    if Path(model).exists():                # a packed file or directory of the user's (pack-safetensors, s3d8 pack)
        return Path(model)
    if model in VISION:
        path = SYNTH_DIR / model / f"{fmt}.safetensors"
        return path if path.exists() else write_vision(model, SYNTH_DIR, files=(fmt,))[fmt]
    if model == "toy":
        return toy_packed(fmt)
    path = SYNTH_DIR / model / f"{fmt}.safetensors"
    if not path.exists():
        from pipeline.synthetic.text import write_synthetic
        write_synthetic(model, SYNTH_DIR)
    return path


def model_formats(model: str, wanted: list[str]) -> tuple[list[str], str | None]:
    """``(formats to run, a note on those left out)``: a user's packed file in its own format; the toy in those with a
    packed layout; a vision preset in those its writer makes (not bf16: 21 GB at the 11B); a text preset in all."""
    if Path(model).exists():
        from pipeline.packed.file import read_metadata
        from pipeline.runtime.generation import packed_file

        return [read_metadata(packed_file(model)).get("format", "?")], None
    if model in vision.VISION_PRESETS:
        from pipeline.synthetic.vision import FILES

        can, why = set(FILES), f"its writer makes {', '.join(FILES)}"
    elif model == "toy":
        can, why = {f.name for f in formats.packable()}, "the toy is packed in formats with a packed layout"
    else:
        can, why = set(wanted), ""
    left = [f for f in wanted if f not in can]
    return [f for f in wanted if f in can], f"{model}: no {', '.join(left)} rows ({why})" if left else None


def llama_cpp_type(name: str) -> tuple[str, str | None, str]:
    """An entry of ``LLAMA_CPP_TYPES``: (ftype, token-embedding type or None, file stem)."""
    ftype, _, embd = name.partition("+embd:")
    return ftype, embd or None, f"{ftype}-embd-{embd}" if embd else ftype


def gguf_file(model: str, qtype: str, threads: int = 2) -> Path:
    """``models/synthetic/<model>/<stem>.gguf``: bf16 GGUF from the synthetic bf16 file, then llama.cpp's
    quantizer (``qtype`` as in ``LLAMA_CPP_TYPES``)."""
    import ctypes

    import llama_cpp
    from pipeline.synthetic.text import write_gguf

    ftype, embd, stem = llama_cpp_type(qtype)
    folder = SYNTH_DIR / model
    src = folder / "bf16.gguf"
    if not src.exists():
        write_gguf(model_file(model, BF16_BASELINE), src)
    out = folder / f"{stem}.gguf"
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        if embd:
            params.token_embedding_type = getattr(llama_cpp, f"GGML_TYPE_{embd}")
        params.nthread = threads
        tmp = folder / f".{stem}.gguf.tmp"
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize {qtype}: status {rc}")
        os.replace(tmp, out)
    return out


def llama_cpp_status() -> str | None:
    """None when the optional extra is importable, else the reason."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return (f"llama.cpp rows skipped: {e.name or e} is not installed "
                f"(pip install -r requirements-bench.txt builds llama.cpp from source)")
    return None


# --- one measurement (child process) ----------------------------------------------------------------------------

def random_prompt(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 32000), (1, n), generator=gen)


def _child_native(spec: dict) -> dict:
    from pipeline.runtime import generation as runtime, models as runtime_models

    torch.set_num_threads(spec["threads"])
    path = runtime.packed_file(spec["path"])
    t0 = time.perf_counter()
    model = runtime.load(spec["path"], spec["impl"], max_len=spec["prompt_tokens"] + spec["new_tokens"] + 8)
    load_s = time.perf_counter() - t0
    lean = isinstance(model, runtime_models.LeanLlama)
    c = None if lean else getattr(model.config, "text_config", model.config)        # transformers' config
    vocab = model.config["vocab_size"] if lean else c.vocab_size
    run = runtime.lean_generate if spec["impl"] == "lean" else runtime.hf_generate
    # warm-up at the prompt's length: the first product of each size class above 16 tokens tunes its path
    t0 = time.perf_counter()
    run(model, {"input_ids": random_prompt(spec["prompt_tokens"], vocab, 1)}, 2)
    warmup_s = time.perf_counter() - t0
    res = run(model, {"input_ids": random_prompt(spec["prompt_tokens"], vocab)}, spec["new_tokens"])
    overhead = (overhead_ms_per_token(model, random_prompt(spec["prompt_tokens"], vocab), spec["new_tokens"])
                if spec["impl"] == "lean" else None)
    kv = model.kv_cache_bytes if lean else (2 * c.num_hidden_layers * c.num_key_value_heads * 4 * (
        c.hidden_size // c.num_attention_heads) * (spec["prompt_tokens"] + spec["new_tokens"]))
    return {"prefill_tokens_per_s": res.prefill_tokens_per_s, "decode_tokens_per_s": res.decode_tokens_per_s,
            "new_tokens": res.new_tokens, "load_s": load_s, "warmup_s": warmup_s, "kv_cache_bytes": kv,
            "weight_bytes": int(getattr(model, "weight_bytes", path.stat().st_size)), "overhead_ms_per_token": overhead,
            "anon_huge_pages_mb": machine.anon_huge_pages_mb()}      # while the model holds its weights


def overhead_ms_per_token(model, prompt: torch.Tensor, new_tokens: int) -> float:
    """Mean milliseconds of a decode token of the lean runtime's C step with every weight product stubbed out
    (``stub_products``): what a token costs beyond its products, at the positions the timed run decoded."""
    from pipeline.runtime import models as runtime_models

    n = prompt.shape[-1]
    if isinstance(model, runtime_models.LeanLlama):
        step = model.native_step(stub_products=True)
    else:
        with torch.inference_mode():
            out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        step = runtime_models.mllama_step(model, out.cache, n + new_tokens, stub_products=True)
    t0 = time.perf_counter()
    for i in range(new_tokens):
        step.step(3 + i, n + i)
    return (time.perf_counter() - t0) / new_tokens * 1e3


def _child_llama_cpp(spec: dict) -> dict:
    import numpy as np
    from llama_cpp import Llama

    n, m, t = spec["prompt_tokens"], spec["new_tokens"], spec["threads"]
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["path"], n_threads=t, n_threads_batch=t, n_ctx=n + m + 16, n_batch=512,
                verbose=False)
    load_s = time.perf_counter() - t0
    vocab = llm.n_vocab()

    import llama_cpp

    def last_logits() -> np.ndarray:
        # llama-cpp-python 0.3.36 fills ``Llama.scores`` only with logits_all=True: read the last position's
        # logits from llama.cpp itself (as its samplers do; reading them is also where llama.cpp synchronises)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,))

    def run(prompt: list[int], new: int):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        stamps, toks = [], []
        for i in range(new):
            tok = int(np.argmax(last_logits()))
            toks.append(tok)
            stamps.append(time.perf_counter())
            if i < new - 1:
                llm.eval([tok])
        return t0, stamps

    began = time.perf_counter()
    run(random_prompt(n, vocab, 1)[0].tolist(), 2)                                 # warm-up, as the native rows
    warmup_s = time.perf_counter() - began
    t0, stamps = run(random_prompt(n, vocab)[0].tolist(), m)
    return {"prefill_tokens_per_s": n / (stamps[0] - t0), "decode_tokens_per_s": (m - 1) / (stamps[-1] - stamps[0]),
            "new_tokens": m, "load_s": load_s, "warmup_s": warmup_s, "weight_bytes": Path(spec["path"]).stat().st_size,
            "kv_cache_bytes": 0}


def child(spec: dict) -> dict:
    out = {"llama.cpp": _child_llama_cpp, "vision": vision.child}.get(spec["impl"], _child_native)(spec)
    out["peak_rss_mb"] = machine.peak_rss_mb()
    return out


def measure(spec: dict, timeout: int = 1800) -> dict:
    """Run ``spec`` in a fresh interpreter; its JSON result, or ``{"error": ...}``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    p = subprocess.run([sys.executable, "-m", "pipeline.bench.generate", "--child", json.dumps(spec)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def read_bandwidth(threads: int = 1, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s of ``threads`` threads each reading its own ``nbytes / threads`` at once (best of
    ``repeats`` passes; the probe releases the GIL), from the kind of memory the runtime reads its weights from
    (``safetensors_io.private_memory``: huge pages advised)."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline import native
    from pipeline.packed import safetensors_io

    bufs = [safetensors_io.private_memory(nbytes // threads).fill_(1) for _ in range(threads)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(native.read_bandwidth_probe, bufs))
            best = min(best, time.perf_counter() - t0)
    return sum(b.numel() for b in bufs) / best


# --- report --------------------------------------------------------------------------------------------------------

def _bits(rec: dict, params: int | None) -> float | None:
    return 8 * rec["weight_bytes"] / params if params else None


def analyse(data: dict) -> list[str]:
    """Goal lines for the markdown (per model and thread count)."""
    recs = data["records"]
    out = []
    keyed = {(r["model"], r["format"], r["impl"], r["threads"]): r for r in recs if "error" not in r}
    models = sorted({r["model"] for r in recs if r["model"] != "toy"})
    for model in models:
        for t in data["threads"]:
            s = keyed.get((model, SUBJECT, "lean", t))
            if not s:
                continue
            line = [f"**{model}, {t} thread(s)**: S3D8 {s['decode_tokens_per_s']:.2f} tokens/s"]
            for fmt, goal in ((INT8_BASELINE, GOALS["s3d8_vs_int8"]), (BF16_BASELINE, GOALS["s3d8_vs_bf16"])):
                o = keyed.get((model, fmt, "lean", t))
                if o:
                    r = s["decode_tokens_per_s"] / o["decode_tokens_per_s"]
                    line.append(f"{r:.2f}x {fmt.upper()} (goal >= {goal}x: {'met' if r >= goal else 'NOT met'})")
            rows = [r for r in recs if r["model"] == model and r["impl"] == "llama.cpp" and r["threads"] == t
                    and "error" not in r]
            cands = [r for r in rows if (r.get("bits_per_weight") or 99) <= 3.5]
            if cands:
                best = max(cands, key=lambda r: r["decode_tokens_per_s"])
                r = s["decode_tokens_per_s"] / best["decode_tokens_per_s"]
                line.append(f"{r:.2f}x llama.cpp's best at <= 3.5 bits ({best['format']}, "
                            f"{best['decode_tokens_per_s']:.2f} tokens/s; goal >= 1.3x: {'met' if r >= 1.3 else 'NOT met'})")
            elif rows:        # llama.cpp keeps embeddings and output at more bits: its 2-bit types may exceed 3.5
                low = min(rows, key=lambda r: r.get("bits_per_weight") or 99)
                r = s["decode_tokens_per_s"] / low["decode_tokens_per_s"]
                line.append(f"no llama.cpp type at <= 3.5 bits/weight here; its lowest, {low['format']} at "
                            f"{low['bits_per_weight']:.2f} bits, decodes {low['decode_tokens_per_s']:.2f} tokens/s "
                            f"(S3D8 {r:.2f}x of it; goal >= 1.3x: {'met' if r >= 1.3 else 'NOT met'})")
            else:
                line.append("llama.cpp: not measured")
            bound = _bandwidth(data, t) / vision.read_per_token(s)
            frac = s["decode_tokens_per_s"] / bound
            line.append(f"{frac:.0%} of the {t}-thread bandwidth bound {bound:.1f} tokens/s (goal >= 80%: "
                        f"{'met' if frac >= 0.8 else 'NOT met'})")
            limit = 1.2 * s["weight_bytes"] / 2**20 + s["kv_cache_bytes"] / 2**20 + 300
            line.append(f"peak RSS {s['peak_rss_mb']:.0f} MB vs limit {limit:.0f} MB "
                        f"({'met' if s['peak_rss_mb'] <= limit else 'NOT met'})")
            out.append("- " + "; ".join(line))
    goal = GOALS["toy_tokens_per_s_1_thread"]
    for r in recs:
        if r["model"] == "toy" and r["impl"] == "lean" and r["threads"] == 1 and "error" not in r:
            met = "met" if r["decode_tokens_per_s"] >= goal else "NOT met"
            out.append(f"- **toy, 1 thread**: {r['decode_tokens_per_s']:.0f} tokens/s (goal >= {goal}: {met}); "
                       f"{r['overhead_ms_per_token']:.3f} ms of a token outside the weight products")
    return out


def _bandwidth(data: dict, threads: int) -> float:
    """Read bandwidth in bytes/s of ``threads`` threads (the largest measured count at or below it)."""
    by = {int(t): bw for t, bw in data.get("read_bandwidth_gb_s_by_threads", {}).items()}
    fit = [t for t in by if t <= threads]
    return (by[max(fit)] if fit else data["read_bandwidth_gb_s"]) * 1e9


def write_report(data: dict, out_dir: Path) -> None:
    recs = data["records"]
    bws = ", ".join(f"{t} thread(s) {bw:.1f} GB/s" for t, bw in data["read_bandwidth_gb_s_by_threads"].items())
    md = ["# Generation benchmark", "",
          f"Machine: {machine.line(data['machine'])}; load average {data['load_average_before']} before, "
          f"{data['load_average_after']} after; read bandwidth {bws} (`native.read_bandwidth_probe`, 1 GiB in all, "
          f"best of 5, huge pages advised as for the weights). Prompt {data['prompt_tokens']} tokens, {data['new_tokens']} new tokens, greedy, EOS ignored; "
          "each row a fresh process. Lean rows decode each token in one C call (`pipeline/runtime/decode_step.py`); "
          "overhead ms/token is that call with the weight products stubbed out. Timings on a shared machine: "
          "compare ratios within this run.", "",
          "| model | format | impl | threads | prefill tok/s | decode tok/s | overhead ms/token | weight MB | "
          "bits/weight | bandwidth bound tok/s | fraction | peak RSS MB | on huge pages MB |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in recs:
        if "error" in r:
            md.append(f"| {r['model']} | {r['format']} | {r['impl']} | {r['threads']} | error: {r['error']} |"
                      " | | | | | | | |")
            continue
        bound = _bandwidth(data, r["threads"]) / vision.read_per_token(r)
        bpw, ovh, huge = r.get("bits_per_weight"), r.get("overhead_ms_per_token"), r.get("anon_huge_pages_mb")
        md.append(f"| {r['model']} | {r['format']} | {r['impl']} | {r['threads']} | {r['prefill_tokens_per_s']:.1f} | "
                  f"{r['decode_tokens_per_s']:.2f} | {'' if ovh is None else f'{ovh:.3f}'} | "
                  f"{r['weight_bytes'] / 1e6:.0f} | {'' if bpw is None else f'{bpw:.2f}'} | {bound:.1f} | "
                  f"{r['decode_tokens_per_s'] / bound:.0%} | {r['peak_rss_mb']:.0f} | {'' if huge is None else f'{huge:.0f}'} |")
    md += ["", "## Goals", "", *analyse(data), *vision.report_lines(recs, lambda t: _bandwidth(data, t)), ""]
    md += [f"- {m}" for m in data.get("notes", [])]
    write_text(out_dir / "bench_generate.md", "\n".join(md) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in recs if "error" not in r]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{r['model']}\n{r['format']} {r['impl']} t{r['threads']}" for r in ok]
    colors = {SUBJECT: "tab:red", INT8_BASELINE: "tab:blue", BF16_BASELINE: "tab:gray"}
    ax.bar(range(len(ok)), [r["decode_tokens_per_s"] for r in ok],
           color=[colors.get(r["format"], "tab:green") for r in ok])
    ax.set_xticks(range(len(ok)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"Decode tokens/s ({data['prompt_tokens']}-token prompt, {data['new_tokens']} new tokens)")
    fig.tight_layout()
    with atomic_path(out_dir / "bench_generate.png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def _n_params(model: str) -> int | None:
    import math

    if model in vision.VISION_PRESETS:
        return sum(math.prod(s) for n, s in vision.tensor_shapes(model).items() if len(s) == 2)
    if model == "toy" or Path(model).exists():
        return None
    from pipeline.synthetic.text import PRESETS, tensor_shapes
    return sum(math.prod(s) for s in tensor_shapes(PRESETS[model]).values() if len(s) == 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tokens/s of packed models")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="toy,synthetic-1b",
                    help="presets (toy, synthetic-1b, ..., synthetic-11b-vision) or paths of packed files / directories")
    ap.add_argument("--formats", default="s3d8,int8,bf16")
    ap.add_argument("--impls", default="lean,hf", help="loops, each run for every format: lean (the C decode step), hf (transformers' generate over "
                    "the native modules), from_pretrained (a packed directory loaded by transformers)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--llama-cpp", action="store_true", help="add llama.cpp rows (optional extra)")
    ap.add_argument("--out", default=str(ROOT / "reports"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in args.threads.split(",")]
    load_before = [round(x, 2) for x in os.getloadavg()]
    bws = {str(t): read_bandwidth(t) / 1e9 for t in threads}      # the buffers are freed before any child starts
    records, notes = [], []
    jobs = []
    for model in args.models.split(","):
        fmts, skipped = model_formats(model, args.formats.split(","))
        if skipped:
            notes.append(skipped)
        for fmt in fmts:
            impls = ["vision"] if model in vision.VISION_PRESETS else args.impls.split(",")
            for impl in impls:
                for t in threads:
                    jobs.append((model, fmt, impl, t, None))
        if args.llama_cpp and model != "toy":
            status = llama_cpp_status()
            if status:
                notes.append(status)
                print(status, file=sys.stderr)
            else:
                for q in LLAMA_CPP_TYPES:
                    for t in threads:
                        jobs.append((model, q, "llama.cpp", t, q))
    for model, fmt, impl, t, q in jobs:
        try:
            path = gguf_file(model, q) if q else model_file(model, fmt)
        except Exception as e:  # a failed build is a row with an error, not a failed run
            records.append({"model": model, "format": fmt, "impl": impl, "threads": t, "error": str(e)[:300]})
            continue
        spec = {"path": str(path), "impl": impl, "threads": t, "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens}
        res = measure(spec)
        rec = {"model": model, "format": fmt, "impl": impl, "threads": t, "prompt_tokens": args.prompt_tokens,
               "new_tokens": args.new_tokens, **res}
        if "weight_bytes" in rec:
            params = _n_params(model)
            rec["bits_per_weight"] = _bits(rec, params)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    toy = [r for r in records if r["model"] == "toy" and "error" not in r]
    for r in toy:
        bound = bws[str(r["threads"])] * 1e9 / r["weight_bytes"]
        notes.append(f"toy ({r['impl']}, {r['threads']} thread(s)): {r['decode_tokens_per_s']:.1f} tokens/s against a "
                     f"bandwidth bound of {bound:.0f} tokens/s for its {r['weight_bytes'] / 1e6:.2f} MB "
                     f"({r['decode_tokens_per_s'] / bound:.0%} of it; at this size a token is its fixed costs)")
    data = {"machine": machine.describe(),
            "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "read_bandwidth_gb_s": bws[str(min(threads))], "read_bandwidth_gb_s_by_threads": bws, "threads": threads, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "goals": GOALS, "notes": notes, "records": records}
    write_json(out_dir / "bench_generate.json", data)
    write_report(data, out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
