"""The evaluation runner: batched greedy generation for any Mllama-style model and processor, scored per task.

Only the public Hugging Face API is used (chat template, processor call, ``generate``), so the same runner
evaluates the bf16 teacher, a student whose Linear modules were swapped for quantised ones, and the 11B model.

    result = evaluate(model, processor, ["toy-vqa", "toy-chartqa", "toy-docvqa", "toy-ai2d"], n=1024)
    result.scores          # {"toy-vqa": 0.97, ...}: lmms-eval's scoring of the generations
    result.avg             # mean over tasks
    result.scores_cleaned  # the cleaned-up variant beside it (ChartQA's answer cleaned, tasks.score_cleaned)
    result.examples        # pyarrow Table: one row per example (prompt, references, response, answer, score, ...)
    result.write_examples("reports/eval_examples.parquet")
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image
import transformers
from transformers import GenerationConfig

from pipeline.chat import chat_prompt
from pipeline.eval.tasks import DEFAULT_N, EvalExample, family_of, load_task, score, score_cleaned
from pipeline.files.atomic import atomic_path

# Generous caps (generation stops when every sequence in a batch has ended); a broken model pays them.
MAX_NEW_TOKENS = {"vqa": 16, "chartqa": 32, "docvqa": 24, "ai2d": 8}
BLANK = (255, 255, 255)


@dataclass
class EvalResult:
    scores: dict[str, float]
    examples: pa.Table
    meta: dict = field(default_factory=dict)
    scores_cleaned: dict[str, float] = field(default_factory=dict)  # beside ``scores``, never instead

    @property
    def avg(self) -> float:
        return sum(self.scores.values()) / len(self.scores) if self.scores else float("nan")

    def summary(self) -> dict:
        """Scores (lmms-eval's), their average, the cleaned-up variant beside them and the run's settings, ready
        for JSON."""
        return {"scores": dict(self.scores), "avg": self.avg, "scores_cleaned": dict(self.scores_cleaned),
                **self.meta}

    def write_examples(self, path) -> None:
        with atomic_path(path) as tmp:
            pq.write_table(self.examples, tmp)


def _greedy_config(model, processor, max_new_tokens: int) -> GenerationConfig:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        temperature=None,  # unset, so the model's sampling defaults (e.g. 0.6 / 0.9) do not leak in
        top_p=None,
        top_k=None,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=processor.tokenizer.pad_token_id,
        bos_token_id=processor.tokenizer.bos_token_id,
    )


@torch.inference_mode()
def generate(
    model,
    processor,
    images: Sequence[Image.Image],
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int = 32,
    on_batch=None,
) -> list[str]:
    """Greedy responses to user ``prompts`` about ``images`` (chat template, left padding, batched), decoded
    as lmms-eval's Llama 3.2 Vision wrapper decodes them: special tokens skipped, nothing stripped.

    Inputs are batched in order of prompt length, to pad less; the responses come back in input order."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    config = _greedy_config(model, processor, max_new_tokens)
    device, dtype = model.device, model.dtype
    out: list[str | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        inputs = processor(
            images=[[images[i].convert("RGB")] for i in idx],
            text=[chat_prompt(processor, prompts[i]) for i in idx],
            add_special_tokens=False,  # the chat template already begins with BOS
            padding=True,
            padding_side="left",
            return_tensors="pt",
        ).to(device)
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        generated = model.generate(**inputs, generation_config=config)
        texts = processor.tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        for i, t in zip(idx, texts):
            out[i] = t  # as is: lmms-eval's harness strips it later, after its filters (tasks.score)
        if on_batch is not None:
            on_batch(len(idx))
    return out  # type: ignore[return-value]


def evaluate(
    model,
    processor,
    tasks: Sequence[str] | Mapping[str, Sequence[EvalExample]],
    *,
    n: int = DEFAULT_N,
    seed: int = 0,
    sources: Mapping[str, str] | None = None,
    batch_size: int = 32,
    max_new_tokens: Mapping[str, int] | None = None,
    blank_image: bool = False,
    progress: bool = False,
) -> EvalResult:
    """Score ``model`` on ``tasks``: task names (loaded with ``n``, ``seed`` and ``sources[name]``), or a
    mapping from task name to examples already loaded.

    ``max_new_tokens`` overrides the per-family caps by task name. ``blank_image`` replaces every image by a
    white one of the same size: the blind baseline, which measures what the text alone gives away."""
    if isinstance(tasks, Mapping):
        loaded = {name: list(examples) for name, examples in tasks.items()}
    else:
        loaded = {name: load_task(name, n, seed, (sources or {}).get(name)) for name in tasks}
    was_training = model.training
    model.eval()
    scores, cleaned, rows, seconds, caps = {}, {}, [], {}, {}
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
    try:
        for name, examples in loaded.items():
            family = family_of(name)
            cap = (max_new_tokens or {}).get(name, MAX_NEW_TOKENS[family])
            caps[name] = cap
            task_bar = bar.add_task(f"eval {name}", total=len(examples)) if bar else None
            images = [Image.new("RGB", e.image.size, BLANK) if blank_image else e.image for e in examples]
            t0 = time.perf_counter()
            responses = generate(
                model, processor, images, [e.prompt for e in examples], max_new_tokens=cap, batch_size=batch_size,
                on_batch=(lambda k, t=task_bar: bar.advance(t, k)) if bar else None,
            )
            seconds[name] = round(time.perf_counter() - t0, 2)
            task_scores, task_cleaned = [], []
            for e, r in zip(examples, responses):
                answer, s = score(family, e, r)
                answer_cleaned, s_cleaned = score_cleaned(family, e, r)
                task_scores.append(s)
                task_cleaned.append(s_cleaned)
                rows.append({
                    "task": name, "id": e.id, "question": e.question, "prompt": e.prompt,
                    "references": list(e.references), "options": list(e.options) if e.options else None,
                    "answer_index": e.answer_index, "response": r, "answer": answer, "score": s,
                    "answer_cleaned": answer_cleaned, "score_cleaned": s_cleaned,
                })
            scores[name] = sum(task_scores) / len(task_scores) if task_scores else float("nan")
            cleaned[name] = sum(task_cleaned) / len(task_cleaned) if task_cleaned else float("nan")
    finally:
        if bar:
            bar.stop()
        model.train(was_training)
    schema = pa.schema([
        ("task", pa.string()), ("id", pa.string()), ("question", pa.string()), ("prompt", pa.string()),
        ("references", pa.list_(pa.string())), ("options", pa.list_(pa.string())), ("answer_index", pa.int64()),
        ("response", pa.string()), ("answer", pa.string()), ("score", pa.float64()),
        ("answer_cleaned", pa.string()), ("score_cleaned", pa.float64()),
    ])
    meta = {
        "n": {name: len(ex) for name, ex in loaded.items()},
        "seed": seed,
        "blank_image": blank_image,
        "batch_size": batch_size,
        "max_new_tokens": caps,
        "seconds": seconds,
        "decoding": "greedy",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    return EvalResult(scores, pa.Table.from_pylist(rows, schema=schema), meta, cleaned)
