"""The worker that runs every sequence of ``s3d8 serve``: one thread, ``max_batch`` sequences in flight (each its own
KV cache and C decoder over the shared weights, their decode tokens one batched C call a round), a bounded queue
in front."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.runtime import generation as runtime
from pipeline.runtime.decode_step import step_batch
from pipeline.runtime.models import LeanLlama, RuntimeInputError, model_kind, read_header
from pipeline.serve.requests import ServeError, number_field, bad, chat_messages, sampling_of


@dataclass(eq=False)
class Job:
    """One request as the worker sees it; ``out`` receives ``("token", id)``, ``("end", finish_reason)`` or
    ``("error", message)`` on the event loop that made it."""

    inputs: dict
    max_tokens: int
    sampling: runtime.Sampling
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    generated: int = 0

    @property
    def prompt_tokens(self) -> int:
        return int(self.inputs["input_ids"].shape[-1])

    def send(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))

@dataclass(eq=False)                # compared by identity (its fields hold tensors)
class _Sequence:
    job: Job
    slot: object
    logits: torch.Tensor
    decoder: object                 # its C decoder (pipeline.runtime.decode_step.DecodeStep)
    gen: torch.Generator
    step: int = 0


class Engine:
    """The model, its tokenizer and one worker thread that runs every sequence (see the module's docstring)."""

    def __init__(self, path: str | Path, *, threads: int = 0, max_batch: int = 4, ctx: int = 2048,
                 max_queue: int = 16, tokenizer: str | None = None, name: str | None = None) -> None:
        if max_batch < 1 or max_queue < 0 or ctx < 2:
            raise RuntimeInputError(f"--max-batch {max_batch} / --max-queue {max_queue} / --ctx {ctx}: expected "
                                    f"at least 1 / 0 / 2")
        self.threads = runtime.check_threads(threads)
        file = runtime.packed_file(path)
        self.kind, self.format = model_kind(file)
        _, meta, _ = read_header(file)
        self.processor = runtime.processor_for(file, meta, tokenizer)
        if self.processor is None:
            raise RuntimeInputError(f"{file}: no tokenizer beside the model or at its source_model; pass --tokenizer")
        from pipeline.chat import is_text_only, tokenizer_of

        self.text_only, self.tokenizer = is_text_only(self.processor), tokenizer_of(self.processor)
        cfg = json.loads(meta["config"])
        context = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
        self.ctx = min(ctx, int(context or ctx))
        self.model = runtime.load(file, "lean", max_len=self.ctx)
        self.eos = runtime.stop_tokens(self.model, self.processor)
        self.slots = [self.model.session(self.ctx) if isinstance(self.model, LeanLlama) else self.model
                      for _ in range(max_batch)]
        self.name = name or (file.parent.name if file.name == "model.safetensors" else file.stem)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.created = int(time.time())
        self.pending: deque[Job] = deque()
        self.active: list[_Sequence] = []
        self.cond = threading.Condition()
        self.closing = False
        self.worker = None                  # run(): the caller's thread, or start() for a thread of its own

    def start(self) -> None:
        """The worker in a thread of its own (tests, embedding); ``s3d8 serve`` runs it on the main thread instead:
        the native decode step runs ~5x slower from a thread other than the main one here (OpenMP)."""
        self.worker = threading.Thread(target=self._run, name="s3d8-serve-worker", daemon=True)
        self.worker.start()

    def run(self) -> None:
        """The worker loop on the calling thread, until :meth:`close` and every request is answered."""
        self._run()

    # requests -> jobs (on the event loop)
    def detok(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def chat_inputs(self, messages) -> dict:
        msgs, images = chat_messages(messages, self.text_only)
        try:
            text = self.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - the template's own complaint (jinja raises its own classes)
            raise bad("messages", f"the model's chat template refused them ({e})") from None
        if images:
            inputs = self.processor(images=images, text=[text], return_tensors="pt", add_special_tokens=False)
        elif self.text_only:
            inputs = self.processor([text], return_tensors="pt", add_special_tokens=False)
        else:
            inputs = self.processor(text=[text], return_tensors="pt", add_special_tokens=False)
        return {k: v for k, v in dict(inputs).items() if isinstance(v, torch.Tensor)}

    def completion_inputs(self, prompt) -> dict:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = prompt
            vocab = len(self.tokenizer)
            if not all(0 <= t < vocab for t in ids):
                raise bad("prompt", f"token ids must lie in 0..{vocab - 1}")
        else:
            raise bad("prompt", "expected a string, a list of one string, or a list of token ids")
        return {"input_ids": torch.tensor([ids])}

    def job(self, inputs: dict, body: dict, field_name: str) -> Job:
        n = int(inputs["input_ids"].shape[-1])
        if n >= self.ctx:
            raise bad(field_name, f"{n} prompt tokens leave no room in the context of {self.ctx} tokens")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = number_field(body, key, self.ctx - n, int, low=1)
        if n + max_tokens > self.ctx:
            raise bad(key, f"{n} prompt tokens + {max_tokens} new tokens exceed the context of {self.ctx} tokens")
        return Job(inputs, max_tokens, sampling_of(body), asyncio.get_running_loop())

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closing:
                raise ServeError(503, "the server is shutting down")
            running = self.max_batch - len(self.slots)
            if len(self.pending) + running >= self.max_batch + self.max_queue:
                raise ServeError(503, f"the server is busy: {running} sequences running, "
                                      f"{len(self.pending)} queued (--max-batch {self.max_batch}, --max-queue "
                                      f"{self.max_queue}); retry later")
            self.pending.append(job)
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify()
        if self.worker is not None and self.worker is not threading.current_thread():
            self.worker.join()

    def health(self) -> dict:
        return {"status": "ok", "model": self.name, "slots": self.max_batch,
                "processing": self.max_batch - len(self.slots),
                "queued": len(self.pending)}

    # the worker thread
    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while True:
                with self.cond:
                    while not (self.pending and self.slots) and not self.active and not self.closing:
                        self.cond.wait()
                    if self.closing and not self.pending and not self.active:
                        return
                    admitted = [(self.pending.popleft(), self.slots.pop())
                                for _ in range(min(len(self.pending), len(self.slots)))]
                try:
                    for job, slot in admitted:
                        self._start(job, slot)
                    self._round()
                except Exception as e:  # noqa: BLE001 - the worker must outlive a bug: fail what runs, go on
                    print(f"s3d8 serve: worker error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    for seq in self.active:
                        seq.job.send("error", f"{type(e).__name__}: {e}")
                    self.slots += [seq.slot for seq in self.active]
                    self.active = []

    def _start(self, job: Job, slot) -> None:
        if job.cancelled:
            self.slots.append(slot)
            return
        try:
            logits, decoder = runtime.begin(slot, job.inputs, job.prompt_tokens + job.max_tokens)
        except Exception as e:  # noqa: BLE001 - one request's failure is its answer, never the server's end
            self.slots.append(slot)
            job.send("error", f"{type(e).__name__}: {e}")
            return
        self.active.append(_Sequence(job, slot, logits, decoder, torch.Generator().manual_seed(job.sampling.seed)))

    def _pick(self, seq: _Sequence) -> int | None:
        """The sequence's next token, sent to its request; None when the sequence ended here."""
        job = seq.job
        if job.cancelled:
            return self._end(seq, None)
        tok = runtime.pick(seq.logits, job.sampling, seq.gen)
        seq.step = job.generated = seq.step + 1
        if tok in self.eos:
            return self._end(seq, "stop")
        job.send("token", tok)
        if seq.step >= job.max_tokens:
            return self._end(seq, "length")
        return tok

    def _round(self) -> None:
        """One token for every sequence in flight: each picks from its logits, then the ones that go on run their
        next position together, one C call reading each weight once for all of them."""
        going = []
        for seq in list(self.active):
            try:
                tok = self._pick(seq)
            except Exception as e:  # noqa: BLE001
                seq.job.send("error", f"{type(e).__name__}: {e}")
                self._end(seq, None)
                continue
            if tok is not None:
                going.append((seq, tok))
        if not going:
            return
        try:
            logits = step_batch([s.decoder for s, _ in going], [t for _, t in going],
                                [s.job.prompt_tokens + s.step - 1 for s, _ in going])
        except Exception as e:  # noqa: BLE001
            for s, _ in going:
                s.job.send("error", f"{type(e).__name__}: {e}")
                self._end(s, None)
            return
        for (s, _), lg in zip(going, logits):
            s.logits = lg

    def _end(self, seq: _Sequence, reason: str | None) -> None:
        self.active.remove(seq)
        self.slots.append(seq.slot)
        if reason is not None:
            seq.job.send("end", reason)
