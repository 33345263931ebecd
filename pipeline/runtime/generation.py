"""Generation runtime on packed models: every Linear on the native kernels, straight from the packed bytes.

Two kinds of packed file run here:

- the pipeline's packed S3D8 Mllama (``models/packed/s3d8/*.safetensors``, SPEC section 7): rebuilt by
  ``load_packed_model(path, kernel="native")`` (every Linear of the language and vision models, the
  projector and ``lm_head`` is a ``native.S3D8Linear``), its embedding the format's row embedding
  (:class:`~pipeline.native.S3D8RowEmbedding`: decodes only the looked-up rows);
- text-only Llama files (``pipeline/synthetic/text.py``: ``s3d8``, and the ``int8`` / ``bf16`` baselines),
  run by :class:`~pipeline.runtime.models.LeanLlama`, a small Llama decoder of our own over the packed tensors (or, with
  ``impl="hf"``, by Hugging Face's ``LlamaForCausalLM`` with the same native modules swapped in).

Generation, greedy or sampled (temperature, top-k, top-p, seeded), with a KV cache, two ways:

- ``impl="hf"``: Hugging Face ``generate`` (its ``DynamicCache``, logits processors, stopping criteria);
- ``impl="lean"`` (the default): our own loop. The prompt runs on torch (Llama files: our decoder with a
  preallocated float32 KV cache, RoPE tables and ``scaled_dot_product_attention``; Mllama files: the HF model,
  ``logits_to_keep=1``), then every decode token is one C call (:mod:`pipeline.runtime.decode_step`: the whole layer
  loop over the same weights and caches, no torch call per operation). ``pipeline/bench/generate.py`` measures
  both loops (``reports/bench_generate.md``).

``python -m pipeline.runtime MODEL_DIR --prompt "..." [--image PATH] [--max-new-tokens N] [--threads N]`` (a packed
model directory, or its ``model.safetensors``; ``s3d8 generate`` is the same command) prints the answer as it comes
(the stop token not printed) and tokens/s at the end. Its prompt is the one eval and teacher-generate give: the
chat template (which begins with BOS) tokenised without further special tokens, so greedy tokens equal Hugging
Face ``generate`` on the same model and input. ``--threads 0`` (the default) keeps torch's default thread count.
Exit status: 0, 1 for an error (one line on stderr: a bad model file, prompt or value), 2 for a command line that
cannot be parsed (argparse).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.runtime.models import (LeanLlama, RuntimeInputError, hf_llama, hf_mllama, mllama_step, model_kind,
                                     read_header)

IMPLS = ("lean", "hf", "from_pretrained")
DEFAULT_IMPL = "lean"


# --- generation --------------------------------------------------------------------------------------------------

@dataclass
class Sampling:
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> int:
    """The next token from float32 ``[vocab]`` logits: argmax, or a draw after temperature / top-k / top-p."""
    if s.greedy:
        return int(torch.argmax(logits))
    logits = logits.float() / max(s.temperature, 1e-6)
    if s.top_k and s.top_k < logits.numel():
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_l, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_l, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_l, -1) > s.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


@dataclass
class Result:
    tokens: list[int]
    prompt_tokens: int
    prefill_s: float               # prompt forward + first token
    decode_s: float                # the remaining tokens
    times: list[float] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s and len(self.tokens) > 1 else float("nan")


def _finish(tokens, prompt_tokens, t0, stamps) -> Result:
    if not stamps:
        return Result(tokens, prompt_tokens, 0.0, 0.0)
    return Result(tokens, prompt_tokens, stamps[0] - t0, stamps[-1] - stamps[0], stamps)


def begin(model, inputs: dict, positions: int):
    """The prompt's forward: ``(logits of its last position, decoder)``, ``decoder.step(token, pos)`` the logits
    of ``token`` at ``pos`` in one C call (:class:`~pipeline.runtime.decode_step.DecodeStep`; several such decoders over
    the same weights step together in :func:`~pipeline.runtime.decode_step.step_batch`). ``model``: a :class:`LeanLlama`
    (its cache grown to ``positions`` if smaller) or a packed HF Mllama (a C decoder with caches of ``positions``
    built from the prompt's)."""
    ids = inputs["input_ids"].reshape(-1)
    if isinstance(model, LeanLlama):
        if positions > model.max_len:
            model.allocate(positions)
        return model.forward(ids, 0), model.native
    kwargs = {k: v for k, v in inputs.items() if k != "attention_mask"}
    cam = kwargs.pop("cross_attention_mask", None)
    out = model(**kwargs, cross_attention_mask=cam, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1], mllama_step(model, out.cache, positions, cam)


def lean_generate(model, inputs: dict, max_new_tokens: int, sampling: Sampling = Sampling(), *,
                  eos: set[int] | None = None, on_token=None) -> Result:
    """Our loop: a :class:`LeanLlama`, or an HF model (Mllama) driven directly with its cache."""
    gen = torch.Generator().manual_seed(sampling.seed)
    n = inputs["input_ids"].numel()
    tokens, stamps = [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits, decoder = begin(model, inputs, n + max_new_tokens)
        for step in range(max_new_tokens):
            tok = pick(logits, sampling, gen)
            tokens.append(tok)
            stamps.append(time.perf_counter())
            if on_token:
                on_token(tok)
            if (eos and tok in eos) or step == max_new_tokens - 1:
                break
            logits = decoder.step(tok, n + step)
    return _finish(tokens, n, t0, stamps)


class _Stamps:
    """A ``generate`` streamer that records when each new token arrives (the first ``put`` is the prompt)."""

    def __init__(self, on_token=None) -> None:
        self.stamps, self.tokens, self.on_token, self._prompt = [], [], on_token, True

    def put(self, value):
        if self._prompt:
            self._prompt = False
            return
        self.stamps.append(time.perf_counter())
        for tok in value.reshape(-1).tolist():
            self.tokens.append(tok)
            if self.on_token:
                self.on_token(tok)

    def end(self):
        pass


def hf_generate(model, inputs: dict, max_new_tokens: int, sampling: Sampling = Sampling(), *,
                eos: set[int] | None = None, on_token=None) -> Result:
    """Hugging Face ``generate`` (``DynamicCache``) on an HF model, timed per token by a streamer."""
    if isinstance(model, LeanLlama):
        raise ValueError("hf_generate needs an HF model: load it with impl='hf'")
    streamer = _Stamps(on_token)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, use_cache=True, streamer=streamer,
                  pad_token_id=0)
    if sampling.greedy:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
        torch.manual_seed(sampling.seed)
    if eos:
        kwargs["eos_token_id"] = sorted(eos)
    else:
        kwargs.update(eos_token_id=None, min_new_tokens=max_new_tokens)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(**inputs, **kwargs)
    return _finish(streamer.tokens, int(inputs["input_ids"].shape[-1]), t0, streamer.stamps)


def generate(model, inputs: dict, max_new_tokens: int, sampling: Sampling = Sampling(), *, impl: str = DEFAULT_IMPL,
             eos: set[int] | None = None, on_token=None) -> Result:
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r}: expected one of {IMPLS}")
    fn = lean_generate if impl == "lean" or isinstance(model, LeanLlama) else hf_generate
    return fn(model, inputs, max_new_tokens, sampling, eos=eos, on_token=on_token)


def load(path: str | Path, impl: str = DEFAULT_IMPL, max_len: int | None = None):
    """The model of a packed file or directory for ``impl``: a :class:`LeanLlama` (Llama, lean), an HF model built
    by the runtime (hf), or the packed directory loaded by transformers' ``from_pretrained`` with its defaults
    (from_pretrained: the way a Hugging Face user loads it; its Linears' bytes in huge-page memory as the
    runtime's)."""
    if impl == "from_pretrained":
        return hf_pretrained(path)
    path = packed_file(path)
    kind, _ = model_kind(path)
    if kind == "mllama":
        return hf_mllama(path)
    return LeanLlama(path, max_len) if impl == "lean" else hf_llama(path)


def hf_pretrained(path: str | Path):
    """``from_pretrained`` of a packed Hugging Face directory (pack-safetensors' or ``s3d8 pack``'s output)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    directory = Path(path).parent if Path(path).is_file() else Path(path)
    if not (directory / "config.json").is_file():
        raise RuntimeInputError(f"{directory}: from_pretrained needs a packed model directory with config.json "
                                f"(pack-safetensors' or `s3d8 pack MODEL DIR`'s output)")
    vision = getattr(AutoConfig.from_pretrained(str(directory)), "vision_config", None) is not None
    model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(str(directory)).eval()
    model.weight_bytes = packed_file(directory).stat().st_size
    return model


def context_length(model) -> int:
    if isinstance(model, LeanLlama):
        return model.context
    cfg = model.config
    cfg = getattr(cfg, "text_config", cfg)
    return int(cfg.max_position_embeddings)


# --- CLI -------------------------------------------------------------------------------------------------------------

def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:        # pragma: no cover - not Linux
        return os.cpu_count() or 1


def packed_file(path: str | Path) -> Path:
    """The packed file of ``path``: the file itself, or a packed model directory's ``model.safetensors`` (what
    pack-safetensors writes beside the config and processor files)."""
    path = Path(path)
    if not path.is_dir():
        return path
    if (path / "model.safetensors").is_file():
        return path / "model.safetensors"
    found = sorted(p.name for p in path.glob("*.safetensors"))
    raise RuntimeInputError(f"{path}: a packed model directory holds model.safetensors; found "
                            f"{', '.join(found) if found else 'no .safetensors file'}")


def processor_for(path: Path, meta: dict[str, str], tokenizer: str | None):
    """The processor (or tokenizer) of packed file ``path``: ``tokenizer`` when given, else the one beside the file,
    else its metadata's ``source_model`` where that exists; ``None`` otherwise (a synthetic Llama: byte tokens)."""
    from pipeline.models import load_processor

    beside = path.parent if any((path.parent / f).is_file() for f in ("processor_config.json", "tokenizer_config.json")) \
        else None
    source = tokenizer or beside or meta.get("source_model")
    if source and Path(source).exists():
        return load_processor(str(source))
    return None


def _inputs(kind: str, processor, prompt: str, image: str | None, vocab: int) -> tuple[dict, object]:
    if kind == "llama" and image:
        raise RuntimeInputError("--image: this model is a text-only Llama; images need an Mllama file")
    if kind == "llama" and processor is None:
        # no tokenizer ships with a synthetic model: UTF-8 bytes are the tokens (ids 3..258) after BOS 1
        ids = [1] + [3 + b for b in prompt.encode()]
        if max(ids) >= vocab:
            raise RuntimeInputError(f"--prompt: byte tokens need a vocabulary of 259, the model has {vocab}")
        return {"input_ids": torch.tensor([ids])}, lambda tokens: "".join(f"<{t}>" for t in tokens)
    if processor is None:
        raise RuntimeInputError("no tokenizer: no processor files beside the packed file and its 'source_model' is "
                                "not a local directory; pass --tokenizer DIR")
    from pipeline.chat import chat_prompt, tokenizer_of

    tokenizer = tokenizer_of(processor)
    if image:
        from PIL import Image
        try:
            img = Image.open(image).convert("RGB")
        except (OSError, ValueError) as e:
            raise RuntimeInputError(f"--image {image}: cannot read it as an image ({e})") from None
        text = chat_prompt(processor, prompt)     # begins with BOS: the processor must not add another
        inputs = dict(processor(images=[img], text=[text], return_tensors="pt", add_special_tokens=False))
    elif tokenizer is processor:                  # a text-only model: its chat template over the text turn
        text = chat_prompt(processor, prompt)
        inputs = dict(processor([text], return_tensors="pt", add_special_tokens=False))
    else:
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = dict(processor(text=[text], return_tensors="pt", add_special_tokens=False))
    inputs = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    return inputs, lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)


def eos_ids(model, processor) -> set[int]:
    """The stop tokens: the generation config's ``eos_token_id``, the tokenizer's EOS and, where the vocabulary
    has it, Llama 3's ``<|eot_id|>`` (what teacher-generate, eval and the CLI stop at)."""
    from pipeline.chat import tokenizer_of

    tokenizer = tokenizer_of(processor)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    extra = [tokenizer.eos_token_id, tokenizer.get_vocab().get("<|eot_id|>")]
    return {int(e) for e in eos + extra if e is not None}


def stop_tokens(model, processor) -> set[int]:
    """What generation stops at: a lean Llama's config EOS, plus the processor's (:func:`eos_ids`) where there is
    one."""
    eos = {t for t in model.eos if t is not None} if isinstance(model, LeanLlama) else set()
    if processor is not None and hasattr(model, "generation_config"):
        eos |= eos_ids(model, processor)
    elif processor is not None:
        from pipeline.chat import tokenizer_of

        eos |= {t for t in (tokenizer_of(processor).eos_token_id,) if t is not None}
    return eos


class TextStream:
    """Prints generated tokens as text as they come, as ``detok(tokens)`` of all so far (a character split
    over tokens is printed once complete); stop tokens are not printed."""

    def __init__(self, detok, stop: set[int], out=None) -> None:
        self.detok, self.stop, self.out = detok, stop, out or sys.stdout
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, token: int) -> None:
        if token in self.stop:
            return
        self.tokens.append(token)
        text = self.detok(self.tokens)
        if not text.endswith("\ufffd"):
            self._emit(text)

    def _emit(self, text: str) -> None:
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text

    def close(self) -> None:
        self._emit(self.detok(self.tokens) if self.tokens else self.printed)
        self.out.write("\n")
        self.out.flush()


def check_threads(threads: int, flag: str = "--threads") -> int:
    """``threads`` of a command line, the same meaning everywhere: 0 leaves torch's default, 1 .. the CPUs
    this process may use sets it; anything else is a RuntimeInputError. Returns the count that holds."""
    cpus = available_cpus()
    if not 0 <= threads <= cpus:
        raise RuntimeInputError(f"{flag} {threads}: use 0 (torch's default) or 1..{cpus} (the CPUs this process "
                                f"may use)")
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


THREADS_HELP = "threads (default 0: torch's default; at most the CPUs this process may use)"


def build_parser(prog: str = "python -m pipeline.runtime") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Generate with a packed S3D8 model on the native kernels: "
                                 "the answer on stdout as it comes, tokens/s on stderr.",
                                 epilog="Exit status: 0 done, 1 an error (one line on stderr), 2 a command line "
                                        "that cannot be parsed.")
    ap.add_argument("model", help="packed model directory (pack-safetensors' output) or its .safetensors file")
    ap.add_argument("--prompt", required=True, help="the user's message (sent through the chat template)")
    ap.add_argument("--image", help="an image file (Mllama models)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    ap.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    ap.add_argument("--impl", choices=IMPLS, default=DEFAULT_IMPL,
                    help=f"generation loop: lean (ours), hf (Hugging Face generate) or from_pretrained (the "
                         f"directory loaded by transformers' from_pretrained, then Hugging Face generate); default "
                         f"{DEFAULT_IMPL}")
    ap.add_argument("--sample", action="store_true", help="sample instead of greedy")
    ap.add_argument("--temperature", type=float, default=0.8, help="with --sample (default 0.8)")
    ap.add_argument("--top-k", type=int, default=0, help="with --sample: keep the k likeliest tokens (default 0: all)")
    ap.add_argument("--top-p", type=float, default=0.95, help="with --sample: nucleus mass kept (default 0.95)")
    ap.add_argument("--seed", type=int, default=0, help="with --sample: the random seed (default 0)")
    ap.add_argument("--tokenizer", help="processor directory (default: beside the model, or its source_model)")
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.runtime") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        if args.max_new_tokens < 1:
            raise RuntimeInputError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
        if args.sample and (args.temperature <= 0 or args.top_k < 0 or not 0 < args.top_p <= 1):
            raise RuntimeInputError(f"--temperature {args.temperature} / --top-k {args.top_k} / --top-p {args.top_p}: "
                                    f"expected temperature > 0, top-k >= 0, 0 < top-p <= 1")
        threads = check_threads(args.threads)
        path = packed_file(args.model)
        kind, fmt = model_kind(path)
        _, meta, _ = read_header(path)
        processor = processor_for(path, meta, args.tokenizer)    # None: a synthetic Llama (byte tokens)
        cfg = json.loads(meta["config"])
        vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size", 0)
        inputs, detok = _inputs(kind, processor, args.prompt, args.image, vocab)
        n = int(inputs["input_ids"].shape[-1])
        ctx = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
        if ctx and n + args.max_new_tokens > ctx:
            raise RuntimeInputError(f"--prompt: {n} prompt tokens + {args.max_new_tokens} new tokens exceed the "
                                    f"model's context of {ctx} tokens")
        try:
            model = load(path, args.impl, max_len=n + args.max_new_tokens)
        except (ValueError, KeyError, OSError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise RuntimeInputError(msg if str(path) in msg
                                    else f"{path}: cannot load the packed model ({msg})") from None
    except (ValueError, OSError) as e:         # RuntimeInputError, and what reading the files raises
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    eos = stop_tokens(model, processor)
    sampling = Sampling(greedy=not args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed)
    stream = TextStream(detok, eos)
    res = generate(model, inputs, args.max_new_tokens, sampling, impl=args.impl, eos=eos, on_token=stream)
    stream.close()
    print(f"[{kind} {fmt}, {args.impl}, {threads} thread(s)] prompt {res.prompt_tokens} tokens: "
          f"{res.prefill_tokens_per_s:.1f} tokens/s; {res.new_tokens} new tokens: "
          f"{res.decode_tokens_per_s:.2f} tokens/s after the first", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
