"""The tiny Mllama: config, deterministic initialisation, response-only labels, train / generate / reload."""

import pytest
import torch
from transformers import AutoModelForImageTextToText, MllamaForConditionalGeneration

from pipeline.toy import model as M
from pipeline.toy import processor as P
from pipeline.toy import tasks
from pipeline.chat import chat_prompt
from pipeline.params import defaults
from pipeline.toy.batch import IGNORE, encode
from pipeline.toy.train import TrainSettings, train

SMALL = defaults(M.ModelSize, "toy_teacher.model", vision_hidden=32, vision_layers=2, vision_global_layers=1,
                 vision_heads=2, vision_intermediate=64, vision_intermediate_layers=[0], text_hidden=64, text_layers=2,
                 cross_attention_layers=[1], text_heads=2, text_kv_heads=1, text_intermediate=128)


@pytest.fixture(scope="module")
def proc():
    return P.build_processor(tasks.text_corpus(30), vocab_size=800)


@pytest.fixture(scope="module")
def config(proc):
    return M.tiny_config(SMALL, P.text_vocab_size(proc))


def test_config_mirrors_the_11b_layout(config, proc):
    assert config.image_token_index == config.text_config.vocab_size == proc.image_token_id
    assert config.text_config.eos_token_id == [1, 8, 9] and config.text_config.pad_token_id == 4
    assert config.vision_config.vision_output_dim == 32 * 2
    assert config.vision_config.supported_aspect_ratios == [[1, 1]]


def test_config_errors_name_the_parameter():
    with pytest.raises(ValueError, match="cross_attention_layers"):
        M.tiny_config(defaults(M.ModelSize, "toy_teacher.model", text_layers=2, cross_attention_layers=[3]), 100)
    with pytest.raises(ValueError, match="patch_size"):
        M.tiny_config(defaults(M.ModelSize, "toy_teacher.model", patch_size=7), 100)


def test_default_size_is_the_committed_teachers(proc):
    """ModelSize's defaults are params.yaml's (toy_teacher.model): about 2 million parameters."""
    model = M.build_model(M.tiny_config(defaults(M.ModelSize, "toy_teacher.model"), P.text_vocab_size(proc)), seed=0)
    assert 1.5e6 < M.count_parameters(model) < 3e6


def test_initialisation_is_deterministic_with_open_gates(config):
    a, b, c = M.build_model(config, 1), M.build_model(config, 1), M.build_model(config, 2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    gates = [p for n, p in a.named_parameters() if n.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate"))]
    assert gates and all(g.detach().item() == 1.0 for g in gates)


def test_labels_cover_the_response_only(proc):
    items = tasks.items("toy-docvqa", 2) + tasks.items("toy-ai2d", 1)
    prompts = [chat_prompt(proc, it.prompt) for it in items]
    batch = encode(proc, [it.image for it in items], prompts, [it.response for it in items])
    eot = proc.tokenizer.convert_tokens_to_ids("<|eot_id|>")
    for i, it in enumerate(items):
        ids, labels = batch["input_ids"][i], batch["labels"][i]
        n_prompt = len(proc.tokenizer(prompts[i], add_special_tokens=False)["input_ids"])
        n_response = len(proc.tokenizer(it.response, add_special_tokens=False)["input_ids"]) + 1
        assert (labels[:n_prompt] == IGNORE).all()
        assert labels[n_prompt : n_prompt + n_response].tolist() == ids[n_prompt : n_prompt + n_response].tolist()
        assert labels[n_prompt + n_response - 1] == eot
        assert (labels[n_prompt + n_response :] == IGNORE).all()  # right padding
        assert proc.decode(ids[n_prompt : n_prompt + n_response - 1]) == it.response
        start = ids.tolist().index(proc.image_token_id)
        assert batch["cross_attention_mask"][i, start:, 0, 0].all() and not batch["cross_attention_mask"][i, :start].any()
    assert not (batch["labels"] == proc.image_token_id).any()
    with pytest.raises(ValueError, match="exactly one"):
        encode(proc, [items[0].image], ["no image token here"], ["x"])


def test_train_step_generate_and_offline_reload(config, proc, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = M.build_model(config, 0)
    items = tasks.items("toy-vqa", 4)
    batch = encode(proc, [it.image for it in items], [chat_prompt(proc, it.prompt) for it in items], [it.response for it in items])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = model(**batch).loss
    first.backward()
    optimizer.step()
    assert torch.isfinite(first)
    model.eval()
    inputs = proc(images=[[items[0].image]], text=[chat_prompt(proc, items[0].prompt)], add_special_tokens=False, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= inputs["input_ids"].shape[1] + 3
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert isinstance(loaded, MllamaForConditionalGeneration)
    assert loaded.dtype == torch.bfloat16
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("name", ["describe_fraction", "plain_template", "describe_format_p"])
def test_training_shares_must_be_probabilities(name):
    with pytest.raises(ValueError, match=f"train.{name}: a probability must lie in \\[0, 1\\], got 1.5"):
        train(None, None, defaults(TrainSettings, "toy_teacher.train", **{name: 1.5}, eval_every=0), seed=0)
