"""An OpenAI request's fields as the runtime takes them: sampling, stop strings, chat messages and their images;
:class:`ServeError`, the error answer naming the field at fault."""

from __future__ import annotations

import base64
import binascii
import io
import json
import secrets

from pipeline.runtime import generation as runtime

UNSUPPORTED = {"n": 1, "logprobs": None, "top_logprobs": None, "echo": False, "best_of": 1, "suffix": None,
               "tools": None, "functions": None, "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0}
MAX_STOPS = 4


class ServeError(Exception):
    """An answer with an error status: OpenAI's error object, ``param`` naming the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 503: "server_busy"}.get(self.status,
                                                                                                  "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ServeError:
    return ServeError(400, f"{param}: {message}", param)


def number_field(body: dict, name: str, default, kind=float, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise bad(name, f"expected {'an integer' if kind is int else 'a number'}, got {json.dumps(value)[:40]}")
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        span = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise bad(name, f"{value} is out of range (expected {span})")
    return kind(value)


def sampling_of(body: dict) -> runtime.Sampling:
    for name, default in UNSUPPORTED.items():
        if body.get(name, default) not in (default, None):
            raise bad(name, "not supported by s3d8 serve")
    temperature = number_field(body, "temperature", 1.0, low=0, high=2)
    seed = number_field(body, "seed", None, int)
    return runtime.Sampling(greedy=temperature == 0, temperature=temperature or 1.0,
                            top_p=number_field(body, "top_p", 1.0, low=0, high=1, low_open=True),
                            top_k=number_field(body, "top_k", 0, int, low=0),
                            seed=secrets.randbits(63) if seed is None else seed)


def stops_of(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise bad("stop", f"expected a non-empty string or a list of at most {MAX_STOPS} of them")
    return stops


def decode_image(url, where: str):
    from PIL import Image

    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise bad(where, "expected a data URL (data:image/...;base64,...); s3d8 serve fetches nothing")
    try:
        return Image.open(io.BytesIO(base64.b64decode(url.split(";base64,", 1)[1], validate=True))).convert("RGB")
    except (binascii.Error, ValueError, OSError) as e:
        raise bad(where, f"cannot decode the image ({e})") from None


def chat_messages(messages, text_only: bool) -> tuple[list[dict], list]:
    """OpenAI ``messages`` as the chat template takes them (a text model: string contents; Mllama: typed parts,
    an image part where the request put it) and the decoded images."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty list of {role, content} objects")
    out, images = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise bad(f"{where}.role", "expected an object whose role is system, user or assistant")
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise bad(f"{where}.content", "expected a string or a list of content parts")
        converted = []
        for j, p in enumerate(parts):
            at = f"{where}.content[{j}]"
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                converted.append({"type": "text", "text": p["text"]})
            elif isinstance(p, dict) and p.get("type") == "image_url":
                if text_only:
                    raise bad(at, "this model is a text-only Llama; images need an Mllama model")
                if images:
                    raise bad(at, "one image per request")
                url = p.get("image_url", {}).get("url") if isinstance(p.get("image_url"), dict) else None
                images.append(decode_image(url, f"{at}.image_url.url"))
                converted.append({"type": "image"})
            else:
                raise bad(at, "expected {type: text, text} or {type: image_url, image_url: {url}}")
        content = "".join(p["text"] for p in converted) if text_only else converted
        out.append({"role": m["role"], "content": content})
    return out, images
