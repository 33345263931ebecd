"""The offline processor: Llama 3 specials, the Llama 3.2 Vision chat template, reload under HF_HUB_OFFLINE."""

import json

import pytest
from transformers import AutoProcessor

from pipeline.toy import processor as P
from pipeline.toy import tasks
from pipeline.chat import chat_prompt, plain_prompt


@pytest.fixture(scope="module")
def corpus():
    return tasks.text_corpus(40)


@pytest.fixture(scope="module")
def proc(corpus):
    return P.build_processor(corpus, vocab_size=1024)


def test_special_tokens_and_image_token(proc):
    tok = proc.tokenizer
    for i, name in enumerate(P.SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(name) == i
    assert tok.bos_token_id == 0 and tok.pad_token_id == 4 and tok.eos_token == "<|eot_id|>"
    assert proc.image_token_id == len(tok) - 1 == P.text_vocab_size(proc)
    assert tok("red")["input_ids"][0] == tok.bos_token_id  # BOS prepended, as by the Llama 3 tokenizer
    assert tok.decode(tok("The image shows a red circle.", add_special_tokens=False)["input_ids"]) == "The image shows a red circle."


def test_any_text_round_trips(proc):
    tok = proc.tokenizer
    text = "Ünïcödé ✓ and {json: [1, 2]} — never seen"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_matches_llama_3_2_vision(proc):
    text = chat_prompt(proc, "What is this?")
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>What is this?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert plain_prompt(proc, "Describe the image.") == "<|begin_of_text|><|image|>Describe the image."
    with pytest.raises(Exception, match="incompatible with system messages"):
        proc.apply_chat_template(
            [{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "y"}]}],
            tokenize=False,
        )


def test_processor_call_gives_all_model_inputs(proc):
    item = tasks.item("toy-vqa", 0, 0)
    inputs = proc(images=[[item.image]], text=[chat_prompt(proc, item.prompt)], add_special_tokens=False, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(0) == 1 and ids[0] == 0  # one BOS
    assert tuple(inputs["pixel_values"].shape) == (1, 1, 1, 3, 64, 64)
    assert inputs["aspect_ratio_ids"].tolist() == [[1]]
    start = ids.index(proc.image_token_id)
    assert inputs["cross_attention_mask"][0, start:, 0, 0].all() and not inputs["cross_attention_mask"][0, :start].any()


def test_tokenizer_build_is_deterministic(corpus, proc):
    again = P.build_processor(corpus, vocab_size=1024)
    assert again.tokenizer.backend_tokenizer.to_str() == proc.tokenizer.backend_tokenizer.to_str()


def test_save_and_reload_offline(proc, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc.save_pretrained(tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"chat_template.jinja", "processor_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    loaded = AutoProcessor.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "MllamaProcessor"
    text = chat_prompt(loaded, "How many shapes are there?")
    assert loaded.tokenizer(text, add_special_tokens=False)["input_ids"] == proc.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert loaded.image_token_id == proc.image_token_id
    config = json.loads((tmp_path / "processor_config.json").read_text())
    assert config["image_processor"]["max_image_tiles"] == 1
