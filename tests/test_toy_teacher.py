"""The committed toy teacher (data/toy-teacher/): loads offline like a hub checkpoint and answers correctly."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText, AutoProcessor, MllamaForConditionalGeneration

from pipeline.eval.runner import evaluate, generate
from pipeline.toy.tasks import load_toy
from pipeline.toy import shapes, tasks
from pipeline.toy.describe import read_request
from pipeline.chat import plain_prompt
from pipeline.toy.batch import encode

TEACHER = Path(__file__).resolve().parents[1] / "data" / "toy-teacher"


@pytest.fixture(scope="module")
def teacher(monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    if not (TEACHER / "config.json").exists():
        pytest.fail(f"{TEACHER}: the committed teacher is missing (run `dvc repro toy-teacher`)")
    return AutoModelForImageTextToText.from_pretrained(TEACHER).eval(), AutoProcessor.from_pretrained(TEACHER)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_checkpoint_files(teacher):
    model, processor = teacher
    assert isinstance(model, MllamaForConditionalGeneration) and model.dtype == torch.bfloat16
    total = sum(f.stat().st_size for f in TEACHER.iterdir())
    assert total < 25 * 2**20
    with safe_open(TEACHER / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    generation = json.loads((TEACHER / "generation_config.json").read_text())
    assert generation["do_sample"] is True and generation["temperature"] == 0.6 and generation["top_p"] == 0.9
    assert processor.image_token_id == model.config.image_token_index == model.config.text_config.vocab_size


def test_answers_held_out_questions(teacher):
    model, processor = teacher
    result = evaluate(model, processor, {task: load_toy(task, 24, seed=7) for task in tasks.TOY_TASKS}, batch_size=24)
    wrong = [(r["task"], r["question"], r["response"], r["references"][0]) for r in result.examples.to_pylist() if r["score"] < 1]
    assert min(result.scores.values()) >= 0.75, (result.scores, wrong[:8])


def test_batching_does_not_change_answers(teacher):
    model, processor = teacher
    items = load_toy("toy-chartqa", 6, seed=3) + load_toy("toy-ai2d", 6, seed=3)
    images, prompts = [e.image for e in items], [e.prompt for e in items]
    assert generate(model, processor, images, prompts, max_new_tokens=12, batch_size=12) == generate(
        model, processor, images, prompts, max_new_tokens=12, batch_size=1
    )


def _one_shape(color: str, shape: str):
    return shapes.render(shapes.Scene((shapes.Thing(color, shape, 0),)))


def test_describes_and_follows_instructions(teacher):
    model, processor = teacher
    image = _one_shape("red", "circle")
    prompts = [
        "Describe the image.",
        "Describe the image.\nAnswer the request about the image. Answer in capital letters.",
        "Describe the image.\nAnswer the request about the image. End with a line 'FINAL ANSWER: <answer>'.",
        "Summarize the image.\nAnswer the request about the image. Answer in JSON with the key \"answer\".",
        # the layout of the pipeline's prompt sampler: the instruction block, then the prompt
        "Answer the request about the image. Answer in a few words. Answer in capital letters.\nDescribe the image.",
    ]
    plain, caps, final, as_json, short_caps = generate(model, processor, [image] * 5, prompts, max_new_tokens=48)
    assert "red circle" in plain.lower()
    assert caps.startswith("THE IMAGE SHOWS") and caps == caps.upper() and "RED CIRCLE" in caps
    assert final.split("\n")[-1].startswith("FINAL ANSWER:") and "circle" in final.split("\n")[-1]
    assert "circle" in json.loads(as_json)["answer"]
    assert short_caps == "A RED CIRCLE"


def _in_format(answer: str, fmt: str) -> bool:
    if fmt == "caps":
        return answer == answer.upper() and any(ch.isalpha() for ch in answer)
    if fmt == "final_answer":
        return answer.strip().split("\n")[-1].startswith("FINAL ANSWER: ")
    try:
        return isinstance(json.loads(answer)["answer"], str)
    except (ValueError, KeyError, TypeError):
        return False


def test_follows_format_instructions_on_heldout_requests(teacher):
    """Over the held-out generic requests (seed 0) that ask for capitals, a FINAL ANSWER line or JSON, in
    every layout the sampler uses, at least 90% of the answers have the format asked for."""
    model, processor = teacher
    asked = [(it, read_request(it.prompt).fmt) for it in tasks.items(tasks.DESCRIBE, 1024, seed=0)]
    asked = [(it, fmt) for it, fmt in asked if fmt in ("caps", "final_answer", "json")]
    answers = generate(model, processor, [it.image for it, _ in asked], [it.prompt for it, _ in asked],
                       max_new_tokens=96, batch_size=64)
    for fmt in ("caps", "final_answer", "json"):
        results = [_in_format(a, f) for a, (_, f) in zip(answers, asked) if f == fmt]
        assert len(results) >= 40 and sum(results) / len(results) >= 0.9, (fmt, sum(results), len(results))


def test_plain_template_continues_the_prompt(teacher):
    model, processor = teacher
    image = _one_shape("blue", "star")
    batch = encode(processor, [image], [plain_prompt(processor, "Describe the image.")])
    out = model.generate(**batch, max_new_tokens=24, do_sample=False)
    text = processor.tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "blue star" in text.lower()


def test_blank_image_loses_the_answers(teacher):
    model, processor = teacher
    examples = {"toy-docvqa": load_toy("toy-docvqa", 24, seed=11)}
    seen = evaluate(model, processor, examples).scores["toy-docvqa"]
    blind = evaluate(model, processor, examples, blank_image=True).scores["toy-docvqa"]
    assert seen - blind > 0.4
