"""Perplexity on a text of the user's choice (llama-perplexity's ``-f``): the teacher, our packed models and
llama.cpp's GGUF files of the same teacher, on the same windows.

    python -m pipeline.bench.perplexity --text /usr/share/common-licenses/GPL-3 --packed models/packed \\
        --gguf 'models/real_model/*.gguf' --out reports/smollm2-135m/independent_text

The check of ``pipeline.bench.real_model`` on a text nothing was calibrated or trained on: that report's perplexity
reads the held-out half of the project's corpus (Python Language Reference prose), whose other half calibrates the
direct cast and trains QAT. Our models load as the eval stage loads them (torch kernels, INT8 activations); a
GGUF through llama-cpp-python (its logits of every position); each model in a process of its own (llama.cpp and a
torch model in one process crash; a GGUF whose child crashes with llama.cpp's extra CPU buffer types is measured
again without them, and its row says so). The perplexity over every position of the first ``--tokens`` tokens of the text,
in windows of ``--window`` tokens (KL against the teacher is ``pipeline.bench.real_model``'s, on its answers).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import math
import sys
from pathlib import Path

import torch

from pipeline import texts
from pipeline.files.atomic import write_json, write_text


def measure(text_path: Path, teacher_dir: Path, packed_root: str, ggufs: list[str], tokens: int, window: int,
            threads: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pipeline.bench import machine
    from pipeline.bench.real_model import packed_models
    from pipeline.eval.text import hf_logits_fn
    from pipeline.stage import console, progress

    body = texts.read_file(text_path, "--text")
    raw = body.encode("utf-8")
    tokenizer = AutoTokenizer.from_pretrained(str(teacher_dir))
    windows = texts.text_windows(body, tokenizer, -(-tokens // window), window, f"--text {text_path}")
    config = AutoConfig.from_pretrained(str(teacher_dir))
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype="auto").eval()  # a rotated one: float32
    dtype = str(teacher.dtype).removeprefix("torch.")
    r = _nll(hf_logits_fn(teacher), windows)
    teacher_ppl, tokens = math.exp(r["nll"] / r["tokens"]), r["tokens"]
    del teacher
    models = packed_models(packed_root, config)[0] if packed_root else []
    models += [{"name": f"llama.cpp {Path(p).stem}", "impl": "llama.cpp", "path": p} for p in ggufs]
    rows = []
    console.print(f"perplexity on {text_path} ({len(windows)} windows): {len(models)} models against {teacher_dir}")
    with progress() as bar:
        task = bar.add_task("models", total=len(models))
        for m in models:
            spec = {"impl": m["impl"], "path": m["path"], "windows": windows, "threads": threads, "extra_bufts": True}
            try:
                r = _in_child(spec)
            except RuntimeError as e:         # llama.cpp's extra CPU buffer types (repacked weights) crash on some
                if m["impl"] == "ours" or not any(sig in str(e) for sig in ("SIGSEGV", "SIGILL")):  # files here
                    raise                                      # (SIGILL: AMX not granted); real_model probes, this retries
                r = _in_child({**spec, "extra_bufts": False})
                m = {**m, "name": m["name"] + " (no extra buffer types)"}
            ppl = math.exp(r["nll"] / r["tokens"])
            rows.append({"name": m["name"], "impl": m["impl"], "path": m["path"],
                         "file_mb": Path(m["path"]).stat().st_size / 1e6, "perplexity": ppl,
                         "x_teacher": ppl / teacher_ppl})
            console.print(f"{m['name']}: perplexity {ppl:.3f}")
            bar.advance(task)
    return {"text": {"path": str(text_path), "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw),
                     "windows": len(windows), "window": window, "predicted_tokens": tokens},
            "teacher": {"dir": str(teacher_dir), "dtype": dtype, "perplexity": teacher_ppl},
            "machine": machine.describe(), "threads": threads, "rows": rows}


def _in_child(spec: dict) -> dict:
    """:func:`child` in a fresh interpreter (llama.cpp and torch's kernels do not share one process safely:
    ``pipeline.bench.real_model`` measures each model apart for the same reason); an error names the model."""
    import json
    import subprocess

    p = subprocess.run([sys.executable, "-m", "pipeline.bench.perplexity", "--child", json.dumps(spec)],
                       capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        from pipeline.bench.real_model import child_failure

        raise RuntimeError(f"{spec['path']}: {child_failure(p)}")
    return json.loads(lines[-1])


def child(spec: dict) -> dict:
    """One model's ``{"nll", "tokens"}`` on the windows (each position's negative log-likelihood of the next token)."""
    torch.set_num_threads(spec["threads"])
    windows = spec["windows"]
    if spec["impl"] == "ours":
        from pipeline.bench.real_model import packed_logits_fn

        fn, _ = packed_logits_fn(spec["path"])
    else:
        from pipeline.bench.llama_cpp_files import llama_cpp_logits_fn

        fn, _ = llama_cpp_logits_fn(spec["path"], max(map(len, windows)) + 8, spec["threads"], spec["extra_bufts"])
    return _nll(fn, windows)


def _nll(fn, windows: list[list[int]]) -> dict:
    from pipeline.eval.text import window_nll

    nll, tokens = window_nll(fn, windows)
    return {"nll": nll, "tokens": tokens}


def verdicts(res: dict) -> list[str]:
    """Each of our models beside each llama.cpp file: lower perplexity at a smaller file?"""
    ours = [r for r in res["rows"] if r["impl"] == "ours"]
    theirs = [r for r in res["rows"] if r["impl"] != "ours"]
    out = []
    for o in ours:
        beaten = [t["name"] for t in theirs if o["perplexity"] < t["perplexity"] and o["file_mb"] < t["file_mb"]]
        out.append(f"{o['name']} ({o['x_teacher']:.2f}x the teacher): below {len(beaten)} of {len(theirs)} "
                   f"llama.cpp files on perplexity at a smaller file"
                   + (f" ({', '.join(beaten)})" if beaten else ""))
    return out


def report_md(res: dict, command: str) -> str:
    from pipeline.bench import machine

    t = res["text"]
    lines = [f"# Perplexity on a text nothing was calibrated or trained on: `{t['path']}`", "", f"`{command}`", "",
             f"Text: {t['bytes']} bytes (sha256 {t['sha256'][:16]}...), {t['windows']} windows of <= {t['window']} "
             f"tokens, {t['predicted_tokens']} predicted tokens. Teacher (`{res['teacher']['dir']}`, "
             f"{res['teacher']['dtype']}) perplexity {res['teacher']['perplexity']:.3f}.", "",
             f"Machine: {machine.line(res['machine'])}; {res['threads']} threads.", "",
             "| model | file MB | perplexity | x teacher |", "| --- | --- | --- | --- |"]
    for r in res["rows"]:
        lines.append(f"| {r['name']} | {r['file_mb']:.1f} | {r['perplexity']:.3f} | "
                     f"{r['x_teacher']:.2f} |")
    return "\n".join(lines + ["", *[f"- {v}" for v in verdicts(res)]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    from pipeline.bench.real_model import params_defaults

    if argv is None and sys.argv[1:2] == ["--child"]:
        import json

        print(json.dumps(child(json.loads(sys.argv[2]))), flush=True)
        return 0
    d = params_defaults()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--text", required=True, help="a UTF-8 text file (e.g. /usr/share/common-licenses/GPL-3), or "
                    "english-heldout: the independent English the package ships (pipeline.texts)")
    ap.add_argument("--teacher", default=d.get("teacher") or "models/teacher", help="the teacher's HF directory")
    ap.add_argument("--packed", default="models/packed", help="our packed models, <format>/<method>/ ('' for none)")
    ap.add_argument("--gguf", action="append", default=[], help="GGUF files (a glob; repeatable)")
    ap.add_argument("--tokens", type=int, default=8192, help="the first N tokens of the text (fewer if it is short)")
    ap.add_argument("--window", type=int, default=d.get("ppl_window") or 512, help="window in tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    ggufs = sorted(p for pattern in args.gguf for p in glob.glob(pattern))
    missing = [p for p in args.gguf if not glob.glob(p)]
    if missing:
        ap.error(f"--gguf {missing[0]!r}: no such file")
    torch.set_num_threads(args.threads)
    text = texts.path(args.text) if args.text in texts.TEXTS else Path(args.text)
    res = measure(text, Path(args.teacher), args.packed, ggufs, args.tokens, args.window, args.threads)
    command = "python -m pipeline.bench.perplexity " + " ".join(sys.argv[1:] if argv is None else argv)
    write_json(f"{args.out}.json", res)
    write_text(f"{args.out}.md", report_md(res, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
