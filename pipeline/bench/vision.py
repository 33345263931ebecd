"""One image and a question through a synthetic Llama 3.2 11B Vision (:mod:`pipeline.synthetic.vision`) on the native
kernels: what ``python -m pipeline.bench.generate --models synthetic-11b-vision`` runs for each file and thread count.

A fresh process loads the packed file (``runtime.models.hf_mllama``: every Linear of the vision tower, projector and
text model on the native S3D8 / INT8 kernels, embeddings mapped from the file and decoding only the rows looked up,
the vision MLPs a block of tokens at a time), tiles a seeded 1120 x 1120 picture as the 11B's processor does (4
tiles of 560 pixels: 6,404 image tokens), and answers a question in the chat template: the vision tower and
projector (``image_encode_s``), the text prompt with the cross-attention states (``prefill_s``: its self-attention
layers and the 8 cross-attention layers' image keys and values), then ``new_tokens`` greedy tokens on the C decode
step (EOS ignored). Time to first token is the two plus the first token's pick (the vision tower's output is dropped
once the projector has read it). The bandwidth bound of a decode token is over the bytes it reads
(:func:`read_per_token`: weights and image keys and values), not the file's. A warm-up with a one-tile picture and a
short answer runs first (the INT8 products tune their path on their first call of a size class), its seconds
recorded as ``warmup_s``. Peak RSS is the process's ``VmHWM``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pipeline.formats import INT8_BASELINE, SUBJECT

QUESTION = "What is in this picture? Describe it in detail."
VISION_PRESETS = ("synthetic-11b-vision", "synthetic-vision-tiny")


def tensor_shapes(model: str) -> dict[str, tuple[int, ...]]:
    from pipeline.synthetic.shape import skeleton_config
    from pipeline.synthetic.vision import PRESETS, tensors

    return tensors(skeleton_config(PRESETS[model]))[0]


def picture(size: tuple[int, int], seed: int = 0):
    """A seeded picture: smooth colour gradients with a few rectangles (what an image processor tiles)."""
    from PIL import Image, ImageDraw

    gen = torch.Generator().manual_seed(seed)
    w, h = size
    ys, xs = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    rgb = torch.stack([xs, ys, (xs + ys) / 2], -1).mul(255).to(torch.uint8).numpy()
    img = Image.fromarray(rgb)
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = (torch.rand(2, generator=gen) * torch.tensor([w * 0.8, h * 0.8])).tolist()
        x1, y1 = x0 + w * 0.15, y0 + h * 0.15
        draw.rectangle([x0, y0, x1, y1], fill=tuple(torch.randint(0, 256, (3,), generator=gen).tolist()))
    return img


def inputs(processor, size: tuple[int, int], question: str = QUESTION) -> dict:
    from pipeline.chat import chat_prompt

    out = processor(images=[picture(size)], text=[chat_prompt(processor, question)], return_tensors="pt",
                    add_special_tokens=False)
    return {k: v for k, v in dict(out).items() if isinstance(v, torch.Tensor)}


def answer(model, batch: dict, new_tokens: int) -> dict:
    """Seconds of each part of one answer (see the module docstring)."""
    from pipeline.runtime.models import mllama_step

    ids, cam = batch["input_ids"], batch["cross_attention_mask"]
    n = ids.shape[-1]
    with torch.inference_mode():
        t0 = time.perf_counter()
        vision = model.model.vision_model(pixel_values=batch["pixel_values"], aspect_ratio_ids=batch["aspect_ratio_ids"],
                                          aspect_ratio_mask=batch["aspect_ratio_mask"]).last_hidden_state
        states = model.model.multi_modal_projector(vision).reshape(-1, vision.shape[-2], model.model.hidden_size)
        del vision                # 6,432 x 7,680 floats for the 11B's four tiles, read by the projector alone
        t1 = time.perf_counter()
        out = model(input_ids=ids, cross_attention_states=states, cross_attention_mask=cam, use_cache=True,
                    logits_to_keep=1)
        step = mllama_step(model, out.cache, n + new_tokens, cam)
        tok = int(out.logits[0, -1].argmax())
        t2 = time.perf_counter()
        for i in range(new_tokens - 1):
            tok = int(step.step(tok, n + i).argmax())
        t3 = time.perf_counter()
    text = model.model.language_model.config
    image_kv = (2 * len(text.cross_attention_layers) * states.shape[0] * states.shape[1] * text.num_key_value_heads
                * (text.hidden_size // text.num_attention_heads) * states.element_size())
    return {"image_tokens": int(states.shape[0] * states.shape[1]), "prompt_tokens": n, "image_kv_bytes": image_kv,
            "image_encode_s": t1 - t0, "prefill_s": t2 - t1, "time_to_first_token_s": t2 - t0,
            "decode_tokens_per_s": (new_tokens - 1) / (t3 - t2) if new_tokens > 1 else float("nan")}


def decode_bytes(path: str | Path) -> int:
    """Bytes of the packed file one decode token reads: every tensor but the vision tower's and the projector's,
    the cross-attention layers' image keys and values (``k_proj`` / ``v_proj``: computed once, in the prefill) and
    the token embedding (a row a token) unless it is also the output head. A decode's bandwidth bound is the read
    bandwidth over these bytes, not over the file's."""
    from pipeline.packed.safetensors_io import read_header

    entries = read_header(path)[0]
    untied = any(n.startswith(("lm_head.", "language_model.lm_head.")) for n in entries)
    skip = ("vision_model.", "multi_modal_projector.", ".cross_attn.k_proj.", ".cross_attn.v_proj.")
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for n, e in entries.items()
               if not any(k in n for k in skip) and not (untied and "embed_tokens." in n))


def child(spec: dict) -> dict:
    """The measurement of one file at one thread count (a fresh process: ``pipeline.bench.generate --child``)."""
    from pipeline.runtime import generation as runtime
    from pipeline.runtime.models import hf_mllama, read_header

    torch.set_num_threads(spec["threads"])
    path = Path(spec["path"])
    t0 = time.perf_counter()
    model = hf_mllama(path)
    load_s = time.perf_counter() - t0
    processor = runtime.processor_for(path, read_header(path)[1], None)
    t0 = time.perf_counter()
    answer(model, inputs(processor, (560, 560), "Hi."), 2)
    warmup_s = time.perf_counter() - t0
    res = answer(model, inputs(processor, (1120, 1120)), spec["new_tokens"])
    return {**res, "load_s": load_s, "warmup_s": warmup_s, "new_tokens": spec["new_tokens"],
            "prefill_tokens_per_s": res["prompt_tokens"] / res["prefill_s"],
            "weight_bytes": path.stat().st_size, "decode_bytes": decode_bytes(path), "kv_cache_bytes": 0}


def read_per_token(rec: dict) -> int:
    """The bytes a record's decode token reads: where the child measured them (vision models) the weights'
    (``decode_bytes``) and the cross-attention layers' image keys and values (``image_kv_bytes``: every token attends
    to all 6,404 of them, in float32), else the whole file (a text model's: every weight is read, its tied embedding
    as the output head; its short self-attention cache is left out)."""
    if rec.get("decode_bytes"):
        return rec["decode_bytes"] + rec.get("image_kv_bytes", 0)
    return rec["weight_bytes"]


GOALS = {"peak_rss_gb": 4.5, "bandwidth_fraction": 0.8, "prefill_vs_int8": 1.3, "decode_vs_int8": 3.0}


def report_lines(records: list[dict], bandwidth) -> list[str]:
    """The vision rows of ``reports/bench_generate.md``: a table and the goals (``bandwidth(threads)``: bytes/s)."""
    rows = [r for r in records if r.get("impl") == "vision"]
    if not rows:
        return []
    out = ["", "## One image and a question (synthetic Llama 3.2 11B Vision)", "",
           "| model | format | threads | image tokens | image encode s | prefill s | time to first token s | "
           "decode tok/s | of the bound | weight GB | peak RSS GB |", "| --- | --- | --- | --- | --- | --- | --- | --- | "
           "--- | --- | --- |"]
    ok = {(r["model"], r["format"], r["threads"]): r for r in rows if "error" not in r}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['format']} | {r['threads']} | error: {r['error']} | | | | | | | |")
            continue
        bound = bandwidth(r["threads"]) / read_per_token(r)
        out.append(f"| {r['model']} | {r['format']} | {r['threads']} | {r['image_tokens']} | {r['image_encode_s']:.1f} | "
                   f"{r['prefill_s']:.1f} | {r['time_to_first_token_s']:.1f} | {r['decode_tokens_per_s']:.2f} | "
                   f"{r['decode_tokens_per_s'] / bound:.0%} | {r['weight_bytes'] / 1e9:.2f} | "
                   f"{r['peak_rss_mb'] / 1024:.2f} |")
    out += ["", "The paper's figures (Llama-Mobile; other hardware: a Pixel 8a phone, 5 cores, and AWS Graviton4): "
            "the 11B Vision in 3.7 GB, S3D8 decode 3.8 tokens/s on the Pixel 8a; on Graviton4 36.8 tokens/s against "
            "26.4 for INT8 (SPEC section 8). Compare ratios, not absolute speeds.", ""]
    for model, t in sorted({(model, t) for model, _, t in ok}):
        s = ok.get((model, SUBJECT, t))
        if s is None:
            continue
        frac = s["decode_tokens_per_s"] / (bandwidth(t) / read_per_token(s))
        line = [f"**{model}, {t} thread(s)**: peak RSS {s['peak_rss_mb'] / 1024:.2f} GB (goal <= "
                f"{GOALS['peak_rss_gb']}: {'met' if s['peak_rss_mb'] / 1024 <= GOALS['peak_rss_gb'] else 'NOT met'})",
                f"decode {frac:.0%} of the bound (goal >= 80%: {'met' if frac >= GOALS['bandwidth_fraction'] else 'NOT met'})"]
        i8 = ok.get((model, INT8_BASELINE, t))
        if i8:
            pre = s["time_to_first_token_s"] / i8["time_to_first_token_s"]
            dec = s["decode_tokens_per_s"] / i8["decode_tokens_per_s"]
            line += [f"image encoding + prefill {pre:.2f}x INT8's time (goal <= {GOALS['prefill_vs_int8']}x: "
                     f"{'met' if pre <= GOALS['prefill_vs_int8'] else 'NOT met'})",
                     f"decode {dec:.2f}x INT8 (goal >= {GOALS['decode_vs_int8']}x: "
                     f"{'met' if dec >= GOALS['decode_vs_int8'] else 'NOT met'})"]
        out.append("- " + "; ".join(line))
    return out
