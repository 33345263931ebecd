"""The evaluation runner on a small untrained Mllama: result shape, determinism, order, Parquet output."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from pipeline.eval.runner import EvalResult, evaluate, generate
from pipeline.eval.tasks import load_benchmark
from pipeline.params import defaults
from pipeline.toy.tasks import load_toy
from pipeline.toy import model as M
from pipeline.toy import processor as P
from pipeline.toy import tasks

AI2D_FIXTURE = "tests/fixtures/ai2d/data/test-00000-of-00001.parquet"
SMALL = defaults(M.ModelSize, "toy_teacher.model", vision_hidden=32, vision_layers=2, vision_global_layers=1,
                 vision_heads=2, vision_intermediate=64, vision_intermediate_layers=[0], text_hidden=64, text_layers=2,
                 cross_attention_layers=[1], text_heads=2, text_kv_heads=1, text_intermediate=128)


@pytest.fixture(scope="module")
def model_and_processor():
    proc = P.build_processor(tasks.text_corpus(30), vocab_size=800)
    model = M.build_model(M.tiny_config(SMALL, P.text_vocab_size(proc)), seed=0).eval()
    return model, proc


def test_evaluate_returns_scores_answers_and_settings(model_and_processor, tmp_path):
    model, proc = model_and_processor
    examples = {name: load_toy(name, 3) for name in tasks.TOY_TASKS}
    examples["ai2d"] = load_benchmark("ai2d", n=2, source=str(Path(__file__).parents[1] / AI2D_FIXTURE))
    result = evaluate(model, proc, examples, batch_size=2, max_new_tokens={"toy-vqa": 2})
    assert isinstance(result, EvalResult)
    assert list(result.scores) == [*tasks.TOY_TASKS, "ai2d"]
    assert all(0.0 <= s <= 1.0 for s in result.scores.values())
    assert result.avg == pytest.approx(sum(result.scores.values()) / 5)
    assert result.examples.num_rows == 14
    rows = result.examples.to_pylist()
    assert {r["task"] for r in rows} == set(result.scores)
    for name in result.scores:
        mean = sum(r["score"] for r in rows if r["task"] == name) / sum(r["task"] == name for r in rows)
        assert mean == pytest.approx(result.scores[name])
    assert result.meta["max_new_tokens"]["toy-vqa"] == 2 and result.meta["n"]["ai2d"] == 2
    assert not model.training
    summary = result.summary()
    assert summary["scores"] == result.scores and summary["avg"] == result.avg and "versions" in summary
    result.write_examples(tmp_path / "answers.parquet")
    table = pq.read_table(tmp_path / "answers.parquet")
    assert table.num_rows == 14 and {"prompt", "references", "response", "answer", "score"} <= set(table.column_names)


def test_generation_is_deterministic_and_in_input_order(model_and_processor):
    model, proc = model_and_processor
    items = load_toy("toy-docvqa", 5)
    images, prompts = [e.image for e in items], [e.prompt for e in items]
    first = generate(model, proc, images, prompts, max_new_tokens=4, batch_size=5)
    assert first == generate(model, proc, images, prompts, max_new_tokens=4, batch_size=5)
    # one at a time, in reverse: each response still belongs to its own input
    single = [generate(model, proc, [i], [p], max_new_tokens=4, batch_size=1)[0] for i, p in zip(images[::-1], prompts[::-1])]
    assert single[::-1] == generate(model, proc, images, prompts, max_new_tokens=4, batch_size=1)


def test_blank_images_and_names(model_and_processor):
    model, proc = model_and_processor
    result = evaluate(model, proc, ["toy-vqa"], n=2, blank_image=True, max_new_tokens={"toy-vqa": 1})
    assert result.meta["blank_image"] is True and result.examples.num_rows == 2


def test_bf16_model_gets_bf16_pixels(model_and_processor):
    model, proc = model_and_processor
    bf16 = M.build_model(model.config, seed=0).to(torch.bfloat16).eval()
    result = evaluate(bf16, proc, {"toy-ai2d": load_toy("toy-ai2d", 2)}, max_new_tokens={"toy-ai2d": 1})
    assert result.examples.num_rows == 2


def test_responses_are_decoded_as_lmms_evals_llama_vision_wrapper_decodes_them(model_and_processor):
    """lmms-eval's ``llama_vision`` model: chat template with the image first, the processor without special
    tokens, greedy ``generate`` one example at a time, ``processor.decode(..., skip_special_tokens=True)`` of the
    new tokens, nothing stripped. Our batched responses are those strings, whitespace included."""
    model, proc = model_and_processor
    items = load_toy("toy-vqa", 4) + load_toy("toy-ai2d", 4)
    ours = generate(model, proc, [e.image for e in items], [e.prompt for e in items], max_new_tokens=6, batch_size=3)
    theirs = []
    for e in items:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": e.prompt}]}]
        prompt = proc.apply_chat_template(messages, add_generation_prompt=True)
        inputs = proc([e.image.convert("RGB")], prompt, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        theirs.append(proc.decode(output[0, inputs["input_ids"].shape[-1]:], skip_special_tokens=True))
    assert ours == theirs
    assert any(r != r.strip() for r in ours)  # the case that matters: whitespace the decoder produced


def test_scores_are_lmms_evals_on_the_raw_response_and_the_cleaned_variant_is_beside(model_and_processor):
    model, proc = model_and_processor
    examples = {name: load_toy(name, 3) for name in tasks.TOY_TASKS}
    result = evaluate(model, proc, examples, batch_size=3, max_new_tokens={name: 6 for name in tasks.TOY_TASKS})
    rows = result.examples.to_pylist()
    assert any(r["response"] != r["response"].strip() for r in rows)  # stored as decoded
    for r in rows:
        if r["task"] in ("toy-vqa", "toy-docvqa"):
            assert r["answer"] == r["response"].strip()  # lmms-eval's harness strip, then the metric
        assert r["score_cleaned"] == r["score"] or r["task"] == "toy-chartqa"
    assert set(result.scores_cleaned) == set(result.scores)
    summary = result.summary()
    assert summary["scores"] == result.scores and summary["scores_cleaned"] == result.scores_cleaned
