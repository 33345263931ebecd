"""The HTTP side of ``s3d8 serve`` (Starlette): the OpenAI routes, their answers whole or streamed as server-sent
events, stop strings applied to the text as it comes."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from pipeline.serve.engine import Engine, Job
from pipeline.serve.requests import ServeError, bad, stops_of


def _held(text: str, stops: list[str]) -> int:
    """How many characters at the end of ``text`` could begin a stop string (held back from a stream)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


async def deltas(engine: Engine, job: Job, stops: list[str]):
    """The answer's text as it comes: ``(delta, None)`` ... then ``("", finish_reason)``. A stop string ends it
    (the string and what follows left out); an incomplete UTF-8 character waits for its next token."""
    tokens, sent = [], ""
    while True:
        kind, value = await job.out.get()
        if kind == "error":
            raise ServeError(500, f"generation failed: {value}")
        if kind == "end":
            text = engine.detok(tokens)
            if text[len(sent):]:
                yield text[len(sent):], None
            yield "", value
            return
        tokens.append(value)
        text = engine.detok(tokens)
        if text.endswith("\ufffd"):
            continue
        cut = min((i for i in (text.find(s, max(0, len(sent) - len(s))) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            job.cancelled = True
            if text[len(sent):cut]:
                yield text[len(sent):cut], None
            yield "", "stop"
            return
        safe = len(text) - _held(text, stops)
        if safe > len(sent):
            yield text[len(sent):safe], None
            sent = text[:safe]


# --- HTTP ------------------------------------------------------------------------------------------------------

def _usage(job: Job) -> dict:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.generated,
            "total_tokens": job.prompt_tokens + job.generated}


class _Shape:
    """The JSON of one endpoint's answers: a whole one, and a stream's chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "s3d8"}

    def whole(self, text: str, finish: str, job: Job) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None} if self.chat
                  else {"index": 0, "text": text, "logprobs": None})
        return {**self._head(self.object), "choices": [{**choice, "finish_reason": finish}], "usage": _usage(job)}

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
        return {**self._head(obj), "choices": [{**choice, "finish_reason": finish}]}

    def usage_chunk(self, job: Job) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": _usage(job)}


def _sse(obj) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _error(e: ServeError):
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers={"Retry-After": "1"} if e.status == 503 else None)


class _Routes:
    """The endpoints over one :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def body_of(self, request) -> dict:
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError as e:
            raise ServeError(400, f"the request body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise ServeError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.engine.name:
            raise ServeError(404, f"model: {str(model)[:80]!r} is not served here (this server has "
                                  f"{self.engine.name!r}; GET /v1/models)", "model", "model_not_found")
        if not isinstance(body.get("stream", False), bool):
            raise bad("stream", "expected true or false")
        return body

    async def answer(self, request, chat: bool):
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import StreamingResponse

        engine = self.engine
        try:
            body = await self.body_of(request)
            if chat:
                inputs = await run_in_threadpool(engine.chat_inputs, body.get("messages"))
            else:
                inputs = await run_in_threadpool(engine.completion_inputs, body.get("prompt"))
            job = engine.job(inputs, body, "messages" if chat else "prompt")
            stops = stops_of(body)
            engine.submit(job)
        except ServeError as e:
            return _error(e)
        shape = _Shape(chat, engine.name)
        if body.get("stream"):
            usage = isinstance(body.get("stream_options"), dict) and bool(body["stream_options"].get("include_usage"))
            return StreamingResponse(self.stream(job, shape, stops, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self.whole(request, job, shape, stops)

    async def stream(self, job: Job, shape: _Shape, stops: list[str], usage: bool):
        try:
            if shape.chat:
                yield _sse(shape.chunk(None, None, first=True))
            async for text, finish in deltas(self.engine, job, stops):
                if text or finish:
                    yield _sse(shape.chunk(text if text else None, finish))
            if usage:
                yield _sse(shape.usage_chunk(job))
        except ServeError as e:
            yield _sse(e.body())
        finally:
            job.cancelled = True          # a client gone mid-stream: its sequence ends at the next token
        yield _sse("[DONE]")

    async def whole(self, request, job: Job, shape: _Shape, stops: list[str]):
        from starlette.responses import JSONResponse

        async def collect():
            parts, finish = [], None
            async for text, finish in deltas(self.engine, job, stops):
                parts.append(text)
            return "".join(parts), finish

        task = asyncio.ensure_future(collect())
        try:
            while not (await asyncio.wait({task}, timeout=0.25))[0]:
                if await request.is_disconnected():       # the client went away: free its sequence
                    task.cancel()
                    return JSONResponse({}, status_code=499)
            text, finish = task.result()
        except ServeError as e:
            return _error(e)
        finally:
            job.cancelled = True
        return JSONResponse(shape.whole(text, finish, job))

    async def chat_completions(self, request):
        return await self.answer(request, True)

    async def completions(self, request):
        return await self.answer(request, False)

    async def models(self, request):
        from starlette.responses import JSONResponse

        e = self.engine
        return JSONResponse({"object": "list",
                             "data": [{"id": e.name, "object": "model", "created": e.created, "owned_by": "s3d8"}]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse(self.engine.health())


def build_app(engine: Engine):
    """The Starlette application over ``engine``; every error an OpenAI error object."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    r = _Routes(engine)

    async def http_error(request, exc: HTTPException):
        return _error(ServeError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    async def crash(request, exc: Exception):
        return _error(ServeError(500, f"internal error: {type(exc).__name__}: {exc}"))

    return Starlette(routes=[Route("/v1/chat/completions", r.chat_completions, methods=["POST"]),
                             Route("/v1/completions", r.completions, methods=["POST"]),
                             Route("/v1/models", r.models, methods=["GET"]),
                             Route("/health", r.health, methods=["GET"])],
                     exception_handlers={HTTPException: http_error, Exception: crash})
