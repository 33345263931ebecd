"""``s3d8 serve``: the OpenAI-compatible endpoint, started in a subprocess on a free port and spoken to with the
official ``openai`` client (chat, streaming, stop strings, seeds, the token-for-token equality with ``s3d8
generate``) and with plain HTTP for the errors; a tiny text Llama (its own tokenizer and chat template) packed by
``s3d8 pack``, and the tiny Mllama with an image. The queue, a client that goes away and SIGTERM run on a server
whose decode step is slowed down, so that requests overlap."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("gguf")

from tests.test_teacher_import import byte_vocabulary, tiny_llama, write_tiny_llama_gguf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SLOW_STEP = """
import sys, time
from pipeline.serve import engine, main
step = engine.Engine._round
engine.Engine._round = lambda self: (time.sleep({delay}), step(self))[1]
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def text_llama(tmp_path_factory):
    from pipeline.cli import main
    from pipeline.teacher.importer import import_teacher

    root = tmp_path_factory.mktemp("serve-llama")
    vocab = byte_vocabulary()
    src = write_tiny_llama_gguf(root / "tiny.gguf", tiny_llama(vocab_size=len(vocab), seed=3), tokens=vocab)
    import_teacher(str(src), root / "teacher")
    assert main(["pack", str(root / "teacher"), str(root / "tiny-llama"), "--eval-tokens", "0",
                 "--calibration-windows", "2", "--window", "64"]) == 0
    return root / "tiny-llama"


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    from tests.stage_helpers import build_tiny_teacher
    from tests.test_hf import write

    root = tmp_path_factory.mktemp("serve-mllama")
    write(build_tiny_teacher(root / "teacher"), "s3d8", root / "tiny-mllama")
    return root / "tiny-mllama"


class Server:
    def __init__(self, model: Path, *args: str, delay: float = 0.0) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        code = SLOW_STEP.format(delay=delay) if delay else "from pipeline.serve import main; raise SystemExit(main())"
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(model), "--port", "0", "--threads", "1", *args],
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        line = self.proc.stderr.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert found, line + self.proc.stderr.read()
        self.url = f"http://127.0.0.1:{found.group(1)}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.model = model.name

    def post(self, path: str, body) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, {**json.loads(e.read()), "headers": {k.lower(): v for k, v in e.headers.items()}}

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> int:
        """SIGTERM; True when the server shut down gracefully (exit status 0)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def llama_server(text_llama):
    server = Server(text_llama, "--max-batch", "4")
    yield server
    assert server.stop()


def chat(server: Server, text: str, **kw):
    return server.client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": text}],
                                                 **kw)


def generate_cli(model: Path, prompt: str, n: int, *extra: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pipeline.runtime.generation", str(model), "--prompt", prompt,
                          "--max-new-tokens", str(n), "--threads", "1", *extra], capture_output=True, text=True,
                         check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out.stdout[:-1]                          # its answer, then a newline


def test_greedy_chat_equals_s3d8_generate_and_streams_the_same(llama_server, text_llama):
    r = chat(llama_server, "the cat sat", max_tokens=24, temperature=0)
    assert r.choices[0].message.content == generate_cli(text_llama, "the cat sat", 24)
    assert r.choices[0].finish_reason in ("stop", "length") and r.model == text_llama.name
    assert r.usage.completion_tokens <= 24 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(chat(llama_server, "the cat sat", max_tokens=24, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices


def test_seeds_and_stop_strings(llama_server):
    a, b, c = (chat(llama_server, "hello", max_tokens=40, temperature=1.0, seed=s).choices[0].message.content
               for s in (7, 7, 8))
    assert a == b and a != c and len(a) > 12
    stop = a[6:9]
    cut = chat(llama_server, "hello", max_tokens=40, temperature=1.0, seed=7, stop=[stop, "\u2603never"])
    assert cut.choices[0].message.content == a[:a.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chat(
        llama_server, "hello", max_tokens=40, temperature=1.0, seed=7, stop=stop, stream=True))
    assert streamed == a[:a.find(stop)]


def test_completions_and_models(llama_server, text_llama):
    r = llama_server.client.completions.create(model=llama_server.model, prompt="the cat", max_tokens=5,
                                               temperature=0)
    assert r.object == "text_completion" and r.usage.prompt_tokens >= 2 and r.usage.completion_tokens <= 5
    assert [m.id for m in llama_server.client.models.list()] == [text_llama.name]
    assert llama_server.get("/health")["status"] == "ok"


def test_concurrent_clients_get_their_own_answers(llama_server):
    prompts = ["the cat", "a dog ran", "hello there", "sat on the mat", "zebra", "one two three"]
    alone = {p: chat(llama_server, p, max_tokens=30, temperature=0).choices[0].message.content for p in prompts}
    got = {}

    def ask(p):
        got[p] = chat(llama_server, p, max_tokens=30, temperature=0).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def test_a_sequence_ending_before_the_others_leaves_them_running(llama_server):
    """Requests of different lengths at once: the short ones end (and leave the batch) while the long ones go on."""
    got = {}

    def ask(n):
        got[n] = chat(llama_server, "the cat", max_tokens=n, temperature=0).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(n,)) for n in (40, 3, 25, 1, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    longest = chat(llama_server, "the cat", max_tokens=40, temperature=0).choices[0].message.content
    assert set(got) == {40, 3, 25, 1, 12} and got[40] == longest
    assert all(longest.startswith(got[n]) for n in got)
    assert llama_server.get("/health")["processing"] == 0


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x " * 400}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}]},
     400, "messages[0].content[0]"),
])
def test_bad_requests_get_a_json_error_naming_the_field(llama_server, body, status, param):
    code, answer = llama_server.post("/v1/chat/completions", body)
    assert code == status and answer["error"]["param"] == param, answer
    assert llama_server.get("/health")["status"] == "ok"


def test_bad_bodies_and_routes(llama_server):
    code, answer = llama_server.post("/v1/chat/completions", b"{not json")
    assert code == 400 and "not JSON" in answer["error"]["message"]
    code, answer = llama_server.post("/v1/completions", {"prompt": {"x": 1}})
    assert code == 400 and answer["error"]["param"] == "prompt"
    code, answer = llama_server.post("/v1/nowhere", {})
    assert code == 404 and "error" in answer
    with pytest.raises(openai.NotFoundError):
        llama_server.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def _png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_mllama_answers_an_image_as_s3d8_generate_does(mllama, tmp_path):
    server = Server(mllama)
    try:
        image = tmp_path / "red.png"
        image.write_bytes(base64.b64decode(_png().split(",", 1)[1]))
        content = [{"type": "image_url", "image_url": {"url": _png()}}, {"type": "text", "text": "what colour?"}]
        r = server.client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}],
                                                  max_tokens=8, temperature=0)
        assert r.choices[0].message.content == generate_cli(mllama, "what colour?", 8, "--image", str(image))
        bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        code, answer = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": bad}]})
        assert code == 400 and answer["error"]["param"] == "messages[0].content[0].image_url.url"
        assert server.get("/health")["status"] == "ok"
    finally:
        assert server.stop()


def test_queue_bound_disconnect_and_sigterm(text_llama):
    server = Server(text_llama, "--max-batch", "1", "--max-queue", "1", delay=0.03)
    try:
        body = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 60, "temperature": 0}
        results = []
        first = threading.Thread(target=lambda: results.append(server.post("/v1/chat/completions", body)))
        second = threading.Thread(target=lambda: results.append(server.post("/v1/chat/completions", body)))
        first.start()
        time.sleep(0.3)
        second.start()
        time.sleep(0.3)
        code, answer = server.post("/v1/chat/completions", body)        # one running, one queued: no room
        assert code == 503 and answer["headers"]["retry-after"] == "1", answer
        first.join()
        second.join()
        assert [c for c, _ in results] == [200, 200] and results[0][1]["choices"] == results[1][1]["choices"]

        stream = server.client.chat.completions.create(model=server.model, stream=True, max_tokens=100,
                                                       messages=body["messages"], temperature=0)
        next(iter(stream))
        stream.close()                                                  # the client goes away mid-stream
        deadline = time.time() + 5
        while server.get("/health")["processing"] and time.time() < deadline:
            time.sleep(0.05)
        assert server.get("/health")["processing"] == 0

        pending = threading.Thread(target=lambda: results.append(server.post("/v1/chat/completions", body)))
        pending.start()
        time.sleep(0.3)
    finally:
        assert server.stop()                       # SIGTERM: the request in flight finishes first
    pending.join()
    assert results[-1][0] == 200 and results[-1][1]["usage"]["completion_tokens"] >= 1


def test_llama_cpp_server_runs_without_extra_buffer_types_where_they_crash(monkeypatch, tmp_path):
    """bench.serve probes the GGUF first: where a prompt pass with llama.cpp's extra buffer types dies, its server
    runs through the wrapper that loads the model without them, and the note says why."""
    from pipeline.bench import real_model, serve

    gguf = tmp_path / "m.gguf"
    monkeypatch.setattr(real_model, "run_child", lambda spec, timeout: {"ok": True})
    argv, note = serve.llama_cpp_server_argv(gguf, 2)
    assert argv[1:3] == ["-m", "llama_cpp.server"] and argv[argv.index("--model") + 1] == str(gguf) and note == ""
    assert argv[argv.index("--n_threads") + 1] == "2"
    monkeypatch.setattr(real_model, "run_child", lambda spec, timeout: {"error": "killed by SIGSEGV"})
    argv, note = serve.llama_cpp_server_argv(gguf, 2)
    assert argv[1:4] == ["-m", "pipeline.bench.serve", serve.NO_EXTRA_BUFTS] and "--model" in argv
    assert "without its extra buffer types" in note and "killed by SIGSEGV" in note
