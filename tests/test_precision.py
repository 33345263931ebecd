"""The precision plan (a format per weight: ``pipeline.formats.precision``), INT8's packed layout, and the sequential cast
(``pipeline.cast.sequential``): each matrix's X^T X taken from the model whose earlier matrices are already cast."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline import formats
from pipeline.cast import ptq, sequential
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.models import load_model, meta_model, quantised_weight_names, states_by_module
from pipeline.packed.file import load_packed_model, read_metadata, write_packed
from pipeline.formats.precision import Precision, check_rules, parse_rules
from pipeline.qat.api import prepare
from tests.conftest import tiny_inputs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_teacher_import import tiny_llama  # noqa: E402

INT8 = formats.get("int8")
S3D8 = formats.get("s3d8")


# --- INT8's packed layout ----------------------------------------------------------------------------------------

def test_int8_packs_what_its_fake_quant_gives_and_slices_by_rows():
    w = torch.randn(37, 50) * torch.linspace(0.1, 3, 37)[:, None]
    t = INT8.pack(w, {})
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == \
        {k: (d, tuple(s)) for k, (d, s) in INT8.packed_specs((37, 50), {}).items()}
    assert torch.equal(INT8.unpack(t, (37, 50)), INT8.quantize(w, {}))
    part, shape = INT8.row_block(t, (37, 50), 6, 20)
    assert torch.equal(INT8.unpack(part, shape), INT8.unpack(t, (37, 50))[6:20])
    assert torch.equal(INT8.values_at_scale(w, {}, t["scale"]) * INT8.expand_scale(t["scale"].float(), w.shape),
                       INT8.unpack(t, (37, 50)))
    bad = dict(t, int8=t["int8"].clone())
    bad["int8"][3, 4] = -128
    with pytest.raises(ValueError, match="-128"):
        INT8.unpack(bad, (37, 50))


def test_int8_native_modules_equal_the_decoded_weight():
    pytest.importorskip("pipeline._s3d8_native")
    from pipeline.quant import fake_quant_activations

    w = torch.randn(24, 64)
    t = INT8.pack(w, {})
    x = torch.randn(5, 64)
    expected = torch.nn.functional.linear(fake_quant_activations(x), INT8.unpack(t, (24, 64)))
    assert torch.allclose(INT8.native_linear(t, (24, 64), None)(x), expected, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[3, 0, 23, 3]])
    assert torch.equal(INT8.row_embedding(t, (24, 64))(ids), INT8.unpack(t, (24, 64))[ids])


# --- the rules ---------------------------------------------------------------------------------------------------

def test_rules_first_match_wins_and_bad_rules_name_themselves():
    plan = Precision(S3D8, {r"embed_tokens$": "int8", r"layers\.1\.": "bf16", r"proj": "int8"})
    assert plan.format_of("model.embed_tokens") is INT8
    assert plan.format_of("model.layers.1.mlp.down_proj") is None
    assert plan.format_of("model.layers.0.mlp.down_proj") is INT8
    assert plan.format_of("lm_head") is S3D8
    assert plan.assigned(["model.embed_tokens", "lm_head", "model.layers.1.x"]) == \
        {"model.embed_tokens": "int8", "model.layers.1.x": "bf16"}
    assert parse_rules("none") == {} and parse_rules(r"embed_tokens$=int8,down=bf16") == \
        {"embed_tokens$": "int8", "down": "bf16"}
    with pytest.raises(ValueError, match=r"not a regular expression"):
        check_rules({"(": "int8"})
    with pytest.raises(ValueError, match=r"pack.precision\['x'\].*'int9'"):
        check_rules({"x": "int9"})
    with pytest.raises(ValueError, match="PATTERN=FORMAT"):
        parse_rules("embed_tokens")


# --- a packed file in several formats -----------------------------------------------------------------------------

def test_mixed_file_loads_each_weight_in_its_format(tiny_checkpoint, tmp_path):
    reader = CheckpointReader(tiny_checkpoint)
    model = meta_model(load_model(str(tiny_checkpoint), torch.float32).config)
    names = [s.removesuffix(".weight") for s in quantised_weight_names(model).values()]
    plan = Precision(S3D8, {r"embed_tokens$": "int8", r"mlp\.down_proj$": "int8", r"layers\.1\.self_attn\.q": "bf16"})
    kept = [n for n in names if plan.format_of(n) is None]
    assert kept and any(plan.format_of(n) is INT8 for n in names)
    states = {n: S3D8.fit(reader.get(f"{n}.weight")) if plan.format_of(n) is S3D8 else {}
              for n in names if plan.format_of(n) is not None}
    other = {n: f for n in states if (f := plan.format_of(n)) is not S3D8}
    teacher = load_model(str(tiny_checkpoint), torch.float32)
    out = tmp_path / "mixed.safetensors"
    summary = write_packed(out, reader, S3D8, states, dtype=torch.float32, other=other,
                           metadata={"config": teacher.config.to_dict()})
    meta = read_metadata(out)
    assert json.loads(meta["formats"]) == {f"{n}.weight": "int8" for n in other}
    assert 2.6 < summary["bits_per_param_actual"] < 8.2
    int8_rows = {n for n in other if other[n] is INT8}
    lin = [n for n in states if "embed_tokens" not in n and not n.startswith("lm_head")]
    shapes = {n: tuple(reader.shape(f"{n}.weight")) for n in states}
    stored = {n: (INT8 if n in int8_rows else S3D8).storage_bytes(shapes[n]) for n in states}
    numel = {n: torch.Size(shapes[n]).numel() for n in states}
    assert summary["bits_per_weight_linears"] == round(8 * sum(stored[n] for n in lin) / sum(numel[n] for n in lin), 4)
    assert summary["bits_per_weight_whole"] > summary["bits_per_weight_linears"]
    packed = load_packed_model(out)
    qat = load_model(str(tiny_checkpoint), torch.float32)
    by_module = {m: st for m, st in states_by_module(qat, states).items()}
    of = {m: plan.format_of(s.removesuffix(".weight")) for m, s in quantised_weight_names(qat).items()}
    prepare(qat, S3D8, {m: by_module.get(m, {}) for m in of if of[m] is not None}, act_quant=True, other=of)
    inputs = tiny_inputs()
    with torch.no_grad():
        expected = qat(**inputs).logits
        assert torch.equal(packed(**inputs).logits, expected), "each weight decoded in its own format"
        assert torch.equal(load_packed_model(out, decode="lazy")(**inputs).logits, expected)
    from safetensors.torch import load_file, save_file

    stale = tmp_path / "stale.safetensors"
    save_file(load_file(str(out)), str(stale), {k: v for k, v in meta.items() if k != "formats"})
    with pytest.raises(ValueError, match="is missing"):
        load_packed_model(stale)   # INT8 bytes in a file that says every weight is S3D8


# --- the sequential cast -----------------------------------------------------------------------------------------

def _collect(model, inputs, module) -> torch.Tensor:
    return sequential.hessians(lambda: [model(**b) for b in inputs], {"m": module})["m"]


def _cast_round(w: torch.Tensor) -> torch.Tensor:
    return (w * 64).round() / 64        # a coarse stand-in for a format: visible in every later X^T X


@pytest.mark.parametrize("tied", [True, False])
def test_sequential_hessians_come_from_the_partly_cast_model(tied):
    model = tiny_llama(tied=tied).float()
    reference = tiny_llama(tied=tied).float()
    inputs = [{"input_ids": torch.randint(0, model.config.vocab_size, (1, n))} for n in (9, 13, 6)]
    seen: dict[str, torch.Tensor | None] = {}
    order: list[str] = []

    def cast(name, weight, hessian):
        assert name not in seen, f"{name} cast twice"
        seen[name], _ = hessian, order.append(name)
        return _cast_round(weight)

    sequential.cast_sequentially(model, inputs, cast)
    saved = {s.removesuffix(".weight") for s in quantised_weight_names(model).values()}
    assert set(seen) == saved
    assert order.index("model.layers.0.self_attn.o_proj") < order.index("model.layers.1.self_attn.q_proj")
    # the reference: cast by hand up to a matrix, then its X^T X from a whole-model forward
    with torch.no_grad():
        for name in order:
            module = reference.get_submodule(name)
            if name == "model.embed_tokens":
                break
            if isinstance(module, nn.Linear):
                expected = _collect(reference, inputs, module)
                assert torch.allclose(seen[name], expected, rtol=1e-4, atol=1e-6), name
            module.weight.copy_(_cast_round(module.weight))
    if tied:
        head = _collect(reference, inputs, reference.lm_head)
        assert torch.allclose(seen["model.embed_tokens"], head, rtol=1e-4, atol=1e-6), "the tied matrix: lm_head's"
    else:
        assert seen["model.embed_tokens"] is None and seen["lm_head"] is not None
    for name in saved:
        assert torch.equal(model.get_submodule(name).weight, _cast_round(reference.get_submodule(name).weight)
                           if name != "model.embed_tokens" else model.get_submodule(name).weight)


def test_sequential_gptq_beats_the_teachers_hessians_on_a_tiny_llama():
    """GPTQ with the partly cast model's X^T X fits the cast model's own inputs: its output error on them is no worse
    than GPTQ on the teacher's (the calibration set)."""
    teacher = tiny_llama(tied=False, intermediate=128).float()
    inputs = [{"input_ids": torch.randint(0, teacher.config.vocab_size, (1, 24), generator=torch.Generator()
                                          .manual_seed(i))} for i in range(6)]
    with torch.no_grad():
        ref = torch.cat([teacher(**b).logits[0] for b in inputs])

    def error(model):
        with torch.no_grad():
            return float(((torch.cat([model(**b).logits[0] for b in inputs]) - ref) ** 2).mean())

    def cast(name, weight, hessian):
        tensors, _ = ptq.cast(S3D8, weight, algorithm="gptq", hessian=hessian)
        return S3D8.unpack(tensors, tuple(weight.shape))

    in_order = tiny_llama(tied=False, intermediate=128).float()
    sequential.cast_sequentially(in_order, inputs, cast)
    at_once = tiny_llama(tied=False, intermediate=128).float()
    linears = {m: at_once.get_submodule(m) for m, _ in quantised_weight_names(at_once).items()
               if isinstance(at_once.get_submodule(m), nn.Linear)}
    found = sequential.hessians(lambda: [at_once(**b) for b in inputs], linears)
    with torch.no_grad():
        for m in quantised_weight_names(at_once):          # the embedding too, without X^T X in both
            module = at_once.get_submodule(m)
            module.weight.copy_(cast(m, module.weight.float(), found.get(m)))
    assert error(in_order) <= error(at_once) * 1.05


# --- the rotation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["orthogonal", "hadamard"])
@pytest.mark.parametrize("tied", [True, False])
def test_rotated_llama_computes_the_same_logits(kind, tied):
    from pipeline.cast.rotate import rotate_llama, rotation

    q = rotation(kind, 64, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    model, rotated = tiny_llama(tied=tied).float(), tiny_llama(tied=tied).float()
    rotate_llama(rotated, kind, seed=3)
    assert not rotated.config.tie_word_embeddings and rotated.lm_head.weight is not rotated.model.embed_tokens.weight
    assert all(torch.equal(n.weight, torch.ones_like(n.weight)) for n in rotated.modules() if "RMSNorm" in type(n).__name__)
    assert not torch.allclose(rotated.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, rotated(input_ids=ids).logits
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), float((a - b).abs().max())
    assert float((a - b).abs().max()) < 1e-4 * float(a.abs().max())


@pytest.mark.parametrize("n", [2, 12, 20, 28, 48, 64, 576, 1280])
def test_hadamard_matrices_of_the_orders_models_use(n):
    """Sylvester, Paley I (12, 20), Paley II (28) and their Kronecker products (48, 576 = 4 x 12 x 12 of SmolLM2,
    1280 = 64 x 20 of Mllama's vision tower): entries +-1, H H^T = n I; powers of 2 as Sylvester alone builds them."""
    from pipeline.cast.rotate import hadamard, rotation

    h = hadamard(n)
    assert torch.equal(h.abs(), torch.ones(n, n, dtype=torch.float64))
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    q = rotation("hadamard", n, seed=1)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    if n & (n - 1) == 0:
        s = torch.ones(1, 1, dtype=torch.float64)
        while s.shape[0] < n:
            s = torch.cat([torch.cat([s, s], 1), torch.cat([s, -s], 1)], 0)
        assert torch.equal(h, s)
    assert hadamard(6) is None and hadamard(100) is None


def test_s3d8_pack_rotates_by_hadamard_where_it_can():
    """``--rotate auto``: hadamard for a Llama or an Mllama's language model of a width with a Hadamard matrix,
    orthogonal for the other widths, nothing for other models."""
    from transformers import LlamaConfig, MllamaConfig, ViTConfig

    from pipeline.cast.rotate import auto_rotation

    assert auto_rotation(LlamaConfig(hidden_size=576)) == "hadamard"
    assert auto_rotation(LlamaConfig(hidden_size=18, num_attention_heads=1, num_key_value_heads=1)) == "orthogonal"
    assert auto_rotation(MllamaConfig(text_config={"hidden_size": 4096})) == "hadamard"
    assert auto_rotation(ViTConfig()) == "none"


def test_rotation_refuses_what_it_cannot_do():
    from pipeline.cast.rotate import rotate_llama, rotation

    with pytest.raises(ValueError, match="no Hadamard matrix of order 100"):
        rotation("hadamard", 100)
    with pytest.raises(ValueError, match="expected one of"):
        rotation("spin", 64)
    gpt2 = type("M", (), {"config": type("C", (), {"model_type": "gpt2"})()})()
    with pytest.raises(ValueError, match="only a text Llama or an Mllama's language model"):
        rotate_llama(gpt2, "orthogonal")


def test_rotated_mllama_computes_the_same_logits_with_an_image():
    """Mllama's language model rotated (cross-attention layers included), its vision tower, projector and the
    cross-attention keys and values (which read the image, not the stream) left as they are: the same logits."""
    from pipeline.cast.rotate import rotate_llama
    from tests.conftest import tiny_inputs, tiny_mllama

    model, rotated = tiny_mllama().float(), tiny_mllama().float()
    for m in (model, rotated):           # the norms and gates a trained model has (the fresh ones: 1 and 0)
        gen = torch.Generator().manual_seed(1)
        for name, p in sorted(m.named_parameters()):
            if name.endswith("norm.weight") or name.endswith("_gate"):
                p.data.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    rotate_llama(rotated, "orthogonal", seed=2)
    text, rtext = model.model.language_model, rotated.model.language_model
    cross = text.cross_attention_layers[0]
    assert torch.equal(rtext.layers[cross].cross_attn.k_proj.weight, text.layers[cross].cross_attn.k_proj.weight)
    assert not torch.allclose(rtext.layers[cross].cross_attn.q_proj.weight, text.layers[cross].cross_attn.q_proj.weight)
    assert all(torch.equal(a, b) for a, b in zip(model.model.vision_model.state_dict().values(),
                                                 rotated.model.vision_model.state_dict().values()))
    assert torch.equal(rtext.norm.weight, torch.ones_like(rtext.norm.weight))
    inputs = tiny_inputs()
    with torch.no_grad():
        a, b = model(**inputs).logits, rotated(**inputs).logits
    assert float((a - b).abs().max()) < 1e-4 * float(a.abs().max()), float((a - b).abs().max())
    with torch.no_grad():                # and the image reaches the logits (the test is not of a text-only path)
        blank = model(**{**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}).logits
    assert float((a - blank).abs().max()) > 1e-3


def test_sequential_cast_walks_mllamas_vision_and_text_layers():
    """Mllama: the vision encoder's layers, its global layers and the text layers (cross-attention ones included,
    with image inputs) each get their X^T X; only embeddings have none."""
    from tests.conftest import tiny_mllama

    model = tiny_mllama().float().eval()
    seen: dict[str, bool] = {}

    def cast(name, weight, hessian):
        seen[name] = hessian is not None
        return (weight * 64).round() / 64

    sequential.cast_sequentially(model, [tiny_inputs(batch=1), tiny_inputs(batch=1, seed=1)], cast)
    assert set(seen) == {s.removesuffix(".weight") for s in quantised_weight_names(model).values()}
    without = sorted(n for n, has in seen.items() if not has)
    assert without and all("embed" in n for n in without), without
    assert any(seen[n] for n in seen if "cross_attn" in n) and any(seen[n] for n in seen if "global_transformer" in n)


def test_self_generated_calibration_text_is_seeded_and_full_length():
    from types import SimpleNamespace

    from pipeline.cast.calibrate import CalibrateParams, calibration_inputs

    model = tiny_llama(tied=True)
    tokenizer = SimpleNamespace(bos_token_id=1, eos_token_id=2)
    p = CalibrateParams(n_prompts=3, max_seq_len=10, seed=4, threads=0, hessian_memory_gb=1.0, source="self",
                        sequential=True, act_order=True)
    a = calibration_inputs(p, tokenizer, "unused", 0, model.config.vocab_size, teacher=model)
    b = calibration_inputs(p, tokenizer, "unused", 0, model.config.vocab_size, teacher=model)
    assert len(a) == 3 and all(x["input_ids"].shape == (1, 10) and x["input_ids"][0, 0] == 1 for x in a)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    p.seed = 5
    c = calibration_inputs(p, tokenizer, "unused", 0, model.config.vocab_size, teacher=model)
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))
    with torch.no_grad():        # the samples are the teacher's: its own next-token distribution, not noise
        logp = torch.log_softmax(model(a[0]["input_ids"]).logits[0, :-1], -1)
        drawn = logp.gather(1, a[0]["input_ids"][0, 1:, None]).mean()
        uniform = logp.mean()
    assert drawn > uniform
    with pytest.raises(ValueError, match="teacher must be given"):
        calibration_inputs(p, tokenizer, "unused", 0, model.config.vocab_size)


def test_joined_calibration_sources_read_each_in_turn(tmp_path):
    """``calibrate.source: A+B``: A's n_prompts sequences, then B's, as each alone gives them; the fingerprint
    changes with either part; a bad part is named."""
    from types import SimpleNamespace

    from pipeline.cast.calibrate import CalibrateParams, calibration_fingerprint, calibration_inputs

    model = tiny_llama(tied=True)
    tokenizer = SimpleNamespace(bos_token_id=1, eos_token_id=2)
    text = tmp_path / "a.txt"
    text.write_text("x")

    def params(source):
        return CalibrateParams(n_prompts=2, max_seq_len=8, seed=4, threads=0, hessian_memory_gb=1.0, source=source,
                               sequential=True, act_order=True)

    def inputs(source):
        return calibration_inputs(params(source), tokenizer, "unused", 0, model.config.vocab_size, teacher=model)

    both, alone = inputs("self+self"), inputs("self")
    assert len(both) == 4 and all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(both, alone + alone))
    fp = calibration_fingerprint(params(f"self+file:{text}"), "unused")
    assert fp[0] == calibration_fingerprint(params("self"), "unused")
    text.write_text("y")
    assert calibration_fingerprint(params(f"self+file:{text}"), "unused") != fp
    with pytest.raises(ValueError, match="'prose' is not one of teacher-answers, corpus, english, self or file:PATH"):
        params("corpus+prose")
