"""Text-only Llama (``LlamaForCausalLM``) beside Mllama in the library, chosen by the teacher's config: loading,
the recipe's quantised modules (tied ``lm_head`` / ``embed_tokens`` quantised once), fitting, and the direct
cast to a packed file whose logits stay close to the teacher's. The teacher is a tiny Llama GGUF written by
the test and imported with ``pipeline.teacher``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from pipeline import formats  # noqa: E402
from pipeline.packed.checkpoint import CheckpointReader  # noqa: E402
from pipeline.cast.fit import fit_model  # noqa: E402
from pipeline.models import (checkpoint_names, load_config, load_model, load_processor, meta_model,  # noqa: E402
                             quantised_weight_names, states_by_module)
from pipeline.packed.file import load_packed_model, write_packed  # noqa: E402
from pipeline.packed.modules import PackedEmbedding, PackedLinear  # noqa: E402
from pipeline.qat.api import prepare  # noqa: E402
from pipeline.teacher.importer import import_teacher  # noqa: E402
from tests.test_teacher_import import tiny_llama, write_tiny_llama_gguf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def imported(tmp_path: Path, tied: bool) -> Path:
    src = write_tiny_llama_gguf(tmp_path / f"tiny-{tied}.gguf", tiny_llama(tied=tied))
    out = tmp_path / f"teacher-{tied}"
    import_teacher(str(src), out)
    return out


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return {tied: imported(root, tied) for tied in (True, False)}


def test_config_chooses_the_model_class(teachers):
    from transformers import LlamaForCausalLM, MllamaForConditionalGeneration, PreTrainedTokenizerBase

    source = str(teachers[True])
    assert isinstance(meta_model(load_config(source)), LlamaForCausalLM)
    model = load_model(source, torch.float32)
    assert isinstance(model, LlamaForCausalLM) and not model.training and model.dtype == torch.float32
    tok = load_processor(source)
    assert isinstance(tok, PreTrainedTokenizerBase) and tok.chat_template
    assert isinstance(meta_model(load_config(str(REPO / "data/toy-teacher"))), MllamaForConditionalGeneration)


@pytest.mark.parametrize("tied", [True, False])
def test_quantised_modules_of_llama(teachers, tied):
    model = meta_model(load_config(str(teachers[tied])))
    names = quantised_weight_names(model)
    layers = [f"model.layers.{i}.{m}" for i in range(2) for m in LINEARS]
    assert sorted(names) == sorted(["model.embed_tokens", "lm_head", *layers])
    assert names["model.embed_tokens"] == "model.embed_tokens.weight"
    # a tied lm_head is the embedding's matrix: one checkpoint name, which the checkpoint holds
    assert names["lm_head"] == ("model.embed_tokens.weight" if tied else "lm_head.weight")
    assert set(names.values()) <= set(CheckpointReader(teachers[tied]).keys())
    assert checkpoint_names(model)["lm_head.weight"] == names["lm_head"]


@pytest.mark.parametrize("tied", [True, False])
def test_fit_and_direct_cast_of_llama(teachers, tmp_path, tied):
    source = teachers[tied]
    fmt = formats.get("s3d8")
    states, report = fit_model(fmt, str(source))
    assert report["summary"]["matrices"] == len(states) == 14 + (1 if tied else 2)
    assert ("lm_head" in states) is (not tied)
    teacher = load_model(str(source), torch.float32)
    by_module = states_by_module(teacher, states)
    assert set(by_module) == set(quantised_weight_names(teacher))
    out = tmp_path / "s3d8.safetensors"
    write_packed(out, CheckpointReader(source), fmt, states, metadata={"config": teacher.config.to_dict()})
    keys = CheckpointReader(out).keys()
    assert ("lm_head.weight.packed" in keys) is (not tied) and "lm_head.weight" not in keys
    packed = load_packed_model(out)
    assert isinstance(packed.lm_head, PackedLinear) and isinstance(packed.model.embed_tokens, PackedEmbedding)
    if tied:                       # one quantised matrix serves both
        assert torch.equal(packed.lm_head.weight, packed.model.embed_tokens.weight)
    ids = torch.randint(3, teacher.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    qat = load_model(str(source), torch.float32)
    prepare(qat, fmt, states_by_module(qat, states), act_quant=True)
    with torch.no_grad():
        want, got = teacher(ids).logits, packed(ids).logits
        assert torch.equal(got, qat(ids).logits)       # the packed file is the fake-quantised model, bit for bit
    # close to the teacher: the logits' error of the order of the weights' (2.67 bits, Gaussian weights: ~0.2;
    # an unrelated model of the same shape is ~1.4)
    assert report["summary"]["rel_rmse"] < 0.25
    assert ((got - want).norm() / want.norm()).item() < 0.45
