"""``s3d8 serve MODEL_DIR``: a packed model behind an OpenAI-compatible HTTP endpoint, on the native runtime.

``POST /v1/chat/completions`` (the model's chat template over ``messages``; Mllama images as ``image_url`` parts
with a ``data:`` URL), ``POST /v1/completions`` (a raw prompt, BOS added as the tokenizer does), ``GET /v1/models``,
``GET /health``. Sampling fields: ``max_tokens`` (or ``max_completion_tokens``; default: the rest of the context),
``temperature`` (0: greedy, the tokens of ``s3d8 generate``), ``top_p``, ``top_k`` (as llama-server and vLLM take
it), ``seed``, ``stop`` (up to 4 strings, not part of the answer), ``stream`` (server-sent events ending in
``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with the counts).

One worker thread runs the model (:class:`Engine`); ``--max-batch`` sequences are in flight at once, each with its
own KV cache and C decoder over the shared weights; a round gives each of them its next token in one C call
(``pipeline.runtime.decode_step.step_batch``: every weight read once for all the rows, each row's logits those of its
sequence alone, bit for bit); a new request's prompt runs between two rounds. Requests beyond that wait in a queue of ``--max-queue``; past it the answer is 503 with
``Retry-After``. A client that goes away (a stream closed, a request dropped) frees its sequence at the next
token. Bad input is a 4xx JSON error naming the field (OpenAI's error object); SIGTERM (uvicorn's graceful
shutdown) stops taking connections, finishes the requests in flight and exits 0. The model's worker runs on the
main thread and the HTTP side in another: the native decode step ran ~5x slower from a non-main thread here.

The HTTP side is Starlette on uvicorn (the ``[serve]`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading

from pipeline.runtime import generation as runtime
from pipeline.serve.app import build_app
from pipeline.serve.engine import Engine

__all__ = ["Engine", "build_app", "build_parser", "main"]


def build_parser(prog: str = "s3d8 serve") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Serve a packed model (text Llama or Mllama) behind an "
                                 "OpenAI-compatible HTTP API on the native runtime.",
                                 epilog="SIGTERM or Ctrl-C: stop taking connections, finish the requests in flight, "
                                        "then exit 0 (uvicorn's graceful shutdown). "
                                        "Exit status 1: a model or option that cannot be served (one line on "
                                        "stderr); 2: a command line that cannot be parsed.")
    ap.add_argument("model", help="packed model directory (pack-safetensors' or s3d8 pack's) or its .safetensors")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    ap.add_argument("--threads", type=int, default=0, help=runtime.THREADS_HELP)
    ap.add_argument("--max-batch", type=int, default=4, help="sequences generated at once (default 4)")
    ap.add_argument("--max-queue", type=int, default=16,
                    help="requests waiting beyond those; more get 503 (default 16)")
    ap.add_argument("--ctx", type=int, default=2048,
                    help="positions of each sequence's KV cache: prompt + answer (default 2048, at most the model's)")
    ap.add_argument("--model-name", help="the model's id in the API (default: the directory's name)")
    ap.add_argument("--tokenizer", help="processor directory (default: beside the model, or its source_model)")
    return ap


def main(argv: list[str] | None = None, prog: str = "s3d8 serve") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        import uvicorn
    except ImportError as e:
        print(f"{prog}: error: needs {e.name}, of the [serve] extra: pip install 's3d8-pipeline[serve]'",
              file=sys.stderr)
        return 1
    try:
        engine = Engine(args.model, threads=args.threads, max_batch=args.max_batch, ctx=args.ctx,
                        max_queue=args.max_queue, tokenizer=args.tokenizer, name=args.model_name)
    except (ValueError, OSError, KeyError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1
    config = uvicorn.Config(build_app(engine), host=args.host, port=args.port, log_level="warning")
    server = uvicorn.Server(config)

    async def serve():
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            print(f"{prog}: {engine.name} ({engine.kind} {engine.format}, {engine.threads} thread(s), "
                  f"{args.max_batch} sequences of {engine.ctx} positions) on http://{args.host}:{port}/v1",
                  file=sys.stderr, flush=True)
        await task

    def http() -> None:                     # the HTTP side in a thread; the model's worker on the main thread
        try:
            asyncio.run(serve())
        finally:
            engine.close()

    def stop(signum, frame) -> None:        # uvicorn's graceful shutdown: no new connections, in-flight finish
        server.should_exit = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    side = threading.Thread(target=http, name="s3d8-serve-http")
    side.start()
    engine.run()
    side.join()
    return 0 if server.started else 1
