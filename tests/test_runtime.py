"""Generation runtime (issue 15): native kernels straight from packed bytes, lean loop vs HF generate,
same tokens as the torch path, synthetic models, CLI errors."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from pipeline import formats, native

from pipeline.runtime import generation as runtime, models as runtime_models
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.formats import s3d8 as s3d8_format
from pipeline.synthetic.text import llama_config, write_gguf, write_synthetic
from tests.conftest import tiny_inputs


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    return write_synthetic("synthetic-tiny", out, seed=0)


@pytest.fixture(scope="module")
def synth_hd64(tmp_path_factory):
    """synthetic-tiny with 64-wide heads (Llama 3.2's), the C decoder's vectorised attention path."""
    cfg = dict(llama_config("synthetic-tiny").to_dict(), head_dim=64)
    return write_synthetic(cfg, tmp_path_factory.mktemp("synth64"), seed=0)


def test_synthetic_files_hold_the_same_weights(synth):
    with safe_open(str(synth["bf16"]), "pt") as b, safe_open(str(synth["int8"]), "pt") as i, \
            safe_open(str(synth["s3d8"]), "pt") as s:
        meta = s.metadata()
        assert meta["llama_mobile_format"] == "llama-mobile-s3d8-packed-v1"
        name = "model.layers.1.mlp.down_proj.weight"
        shape = tuple(json.loads(meta["shapes"])[name])
        ref = b.get_tensor(name).float()
        w8 = i.get_tensor(f"{name}.int8").float() * i.get_tensor(f"{name}.scale").float()
        w3 = s3d8_format.decode(s.get_tensor(f"{name}.packed"), s.get_tensor(f"{name}.scale"),
                                s.get_tensor(f"{name}.table"), shape)
        rel = lambda w: float((w - ref).norm() / ref.norm())  # noqa: E731
        assert rel(w8) < 0.02 and rel(w3) < 0.3
        kurt = ((ref / ref.std(1, keepdim=True)) ** 4).mean()
        assert kurt > 3.5, "heavy tails (Student-t)"
    again = write_synthetic("synthetic-tiny", synth["bf16"].parent.parent / "again", seed=0, formats=("s3d8",))
    assert again["s3d8"].read_bytes() == synth["s3d8"].read_bytes(), "seeded, deterministic"


@pytest.mark.parametrize("fmt", ["s3d8", "int8", "bf16"])
def test_lean_llama_equals_hf_llama_on_the_same_kernels(synth, fmt):
    lean, hf = runtime_models.LeanLlama(synth[fmt], 64), runtime_models.hf_llama(synth[fmt])
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = lean.forward(ids[0], 0), hf(input_ids=ids).logits[0, -1]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    greedy_lean = runtime.generate(lean, {"input_ids": ids}, 12, impl="lean")
    greedy_hf = runtime.generate(hf, {"input_ids": ids}, 12, impl="hf")
    assert greedy_lean.tokens == greedy_hf.tokens and len(greedy_lean.tokens) == 12
    s = runtime.Sampling(greedy=False, temperature=0.9, top_k=40, top_p=0.9, seed=3)
    one = runtime.generate(lean, {"input_ids": ids}, 12, s)
    assert one.tokens == runtime.generate(lean, {"input_ids": ids}, 12, s).tokens, "seeded sampling repeats"
    assert all(0 <= t < 300 for t in one.tokens)
    assert one.decode_tokens_per_s > 0 and one.prefill_tokens_per_s > 0


@pytest.mark.parametrize("fmt,heads", [("s3d8", 24), ("int8", 24), ("bf16", 24), ("s3d8", 64), ("bf16", 64)])
def test_c_decode_step_gives_the_torch_paths_tokens_and_cache(synth, synth_hd64, fmt, heads):
    """A decode token in one C call (pipeline/runtime/decode_step.py) against the torch general path on the same weights:
    the same greedy tokens, logits and K/V cache equal to float32 rounding (the RMSNorm mean, SiLU's exp and the
    attention sums are summed in another order than torch's; the products, RoPE and residuals are the same
    arithmetic)."""
    ids = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(2))
    path = (synth if heads == 24 else synth_hd64)[fmt]   # 24: scalar attention sums; 64: 16 keys a vector
    a, b = runtime_models.LeanLlama(path, 40), runtime_models.LeanLlama(path, 40)
    la, lb = a.forward(ids, 0), b.forward(ids, 0)
    for pos in range(6, 40):
        ta, tb = int(la.argmax()), int(lb.argmax())
        assert ta == tb, (fmt, pos)
        la, lb = a.forward(torch.tensor([ta]), pos), b.forward(torch.tensor([tb]), pos, step=False)
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.k_cache, b.k_cache, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.v_cache, b.v_cache, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="token out of range"):
        a.native.step(300, 7)
    with pytest.raises(ValueError, match="beyond|inconsistent|position"):
        a.native.step(1, 40)
    stub = a.native_step(stub_products=True)
    assert torch.equal(stub.step(5, 7), torch.zeros(stub.vocab)), "no product ran: lm_head wrote nothing"


def test_s3d8_lean_llama_equals_the_torch_fake_quant_reference(synth):
    """The lean decoder on native kernels vs HF Llama with decoded weights and fake-quantised INT8
    activations (the QAT forward): the same greedy tokens."""
    from pipeline.packed.modules import PackedLinear

    lean = runtime_models.LeanLlama(synth["s3d8"], 64)
    ref = runtime_models.hf_llama(synth["s3d8"])
    for name, module in list(ref.named_modules()):
        if type(module).__name__ == "S3D8Linear":
            w = s3d8_format.decode(module.packed, module.scale, module.table, module.shape)
            parent, _, leaf = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, leaf, PackedLinear(w, None, act_quant=True))
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    assert runtime.generate(lean, {"input_ids": ids}, 10).tokens == runtime.generate(ref, {"input_ids": ids}, 10,
                                                                                      impl="hf").tokens


def test_row_embedding_decodes_only_what_it_needs_and_equals_decode():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(301, 40, generator=gen)
    table = s3d8_format.fit_centroids(w, seed=0, max_vectors=4096)
    packed, scale = s3d8_format.encode(w, table)
    emb = native.S3D8RowEmbedding(packed, scale, table, (301, 40))
    full = s3d8_format.decode(packed, scale, table, (301, 40))
    ids = torch.tensor([[300, 0, 5, 5, 299], [1, 2, 3, 150, 151]])
    assert torch.equal(emb(ids), full[ids])
    with pytest.raises(IndexError):
        emb(torch.tensor([301]))


@pytest.fixture(scope="module")
def packed_toy(tmp_path_factory, tiny_checkpoint):
    from pipeline.models import load_model, meta_model, quantised_weight_names
    from pipeline.packed.file import write_packed

    reader = CheckpointReader(tiny_checkpoint)
    teacher = load_model(str(tiny_checkpoint), torch.float32)
    names = quantised_weight_names(meta_model(teacher.config))
    fmt = formats.get("s3d8")
    states = {s.removesuffix(".weight"): fmt.fit(reader.get(s)) for s in names.values()}
    out = tmp_path_factory.mktemp("packed") / "s3d8.safetensors"
    write_packed(out, reader, fmt, states, dtype=torch.float32, metadata={"config": teacher.config.to_dict()})
    return out


def test_packed_mllama_runs_native_and_gives_the_torch_paths_tokens(packed_toy):
    from pipeline import native
    from pipeline.packed.file import load_packed_model

    model = runtime_models.hf_mllama(packed_toy)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "S3D8Linear" in kinds and "S3D8RowEmbedding" in kinds
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules()), "every Linear native"
    assert any(isinstance(m, native.S3D8Linear) and m.shape[0] == 60 for m in model.modules()), "lm_head native"
    torch_model = load_packed_model(packed_toy, kernel="torch")
    inputs = {k: v[:1] for k, v in tiny_inputs(batch=1, length=7).items()}
    with torch.no_grad():
        ref = torch_model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                   min_new_tokens=10, pad_token_id=0)[0, 7:].tolist()
    lean = runtime.generate(model, inputs, 10, impl="lean")
    hf = runtime.generate(model, inputs, 10, impl="hf")
    assert lean.tokens == ref and hf.tokens == ref
    text_only = {"input_ids": inputs["input_ids"][:, 2:]}
    with torch.no_grad():
        ref = torch_model.generate(**text_only, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                   min_new_tokens=6, pad_token_id=0)[0, 5:].tolist()
    assert runtime.generate(model, text_only, 6).tokens == ref


@pytest.mark.parametrize("image", [True, False])
def test_c_decode_step_of_mllama_equals_hf_steps(packed_toy, image):
    """Mllama's language model in the C decoder: logits of each decode token equal the HF model's own step on its
    cache, with the cross-attention layers live (gates made non-zero, the image's K/V from the prompt) or skipped
    (a text-only prompt, as HF skips them)."""
    model = runtime_models.hf_mllama(packed_toy)
    with torch.no_grad():
        for i, layer in enumerate(model.model.language_model.layers):
            if hasattr(layer, "cross_attn"):
                layer.cross_attn_attn_gate.fill_(0.6 + 0.1 * i)
                layer.cross_attn_mlp_gate.fill_(-0.8)
    inputs = {k: v[:1] for k, v in tiny_inputs(batch=1, length=7).items() if k != "attention_mask"}
    if not image:
        inputs = {"input_ids": inputs["input_ids"][:, 2:]}
    cam = inputs.pop("cross_attention_mask", None)
    n = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = model(**inputs, cross_attention_mask=cam, use_cache=True, logits_to_keep=1)
        native = runtime_models.mllama_step(model, out.cache, n + 8, cam)
        cross = sum(hasattr(layer, "cross_attn") for layer in model.model.language_model.layers)
        assert cross and sum(L.skip for L in native._layers[0:native.d.n_layers]) == (0 if image else cross)
        tok = int(out.logits[0, -1].argmax())
        for step in range(8):
            out = model(input_ids=torch.tensor([[tok]]), cache=out.cache, use_cache=True, logits_to_keep=1,
                        cross_attention_mask=None if cam is None else cam[:, -1:])
            want, got = out.logits[0, -1], native.step(tok, n + step)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            tok = int(want.argmax())


@pytest.mark.parametrize("fmt", ["s3d8", "int8", "bf16"])
def test_batched_c_step_gives_each_sequence_its_own_steps_bits(synth, fmt):
    """Several sequences in one C call (each weight read once for all): every row's logits and K/V cache equal
    the same sequence stepped alone, bit for bit, whatever the other rows hold; a step of decoders over other
    weights is refused."""
    from pipeline.runtime import decode_step

    model = runtime_models.LeanLlama(synth[fmt], 40)
    prompts = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 6, 9)]
    together, alone = [model.session(40) for _ in prompts], [model.session(40) for _ in prompts]
    toks = [int(s.forward(p, 0).argmax()) for s, p in zip(together, prompts)]
    for s, p in zip(alone, prompts):
        s.forward(p, 0)
    pos = [p.numel() for p in prompts]
    for _ in range(6):
        batch = [lg.clone() for lg in decode_step.step_batch([s.native for s in together], toks, pos)]
        for s, tok, p, lg in zip(alone, toks, pos, batch):
            assert torch.equal(s.native.step(tok, p), lg)
        toks, pos = [int(lg.argmax()) for lg in batch], [p + 1 for p in pos]
    for a, b in zip(together, alone):
        assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)
    other = runtime_models.LeanLlama(synth[fmt], 40)
    with pytest.raises(ValueError, match="do not share their weights"):
        decode_step.step_batch([together[0].native, other.native], [1, 1], [pos[0], 1])
    with pytest.raises(ValueError, match="token out of range"):
        decode_step.step_batch([s.native for s in together], [1, 300, 1], pos)


def test_batched_c_step_of_mllama_mixes_image_and_text_requests(packed_toy):
    """Mllama requests with and without an image in one batch: the cross-attention layers run for the rows that
    have an image's K/V and are left out for the others, each row's logits its own step's."""
    from pipeline.runtime import decode_step

    model = runtime_models.hf_mllama(packed_toy)
    inputs = {k: v[:1] for k, v in tiny_inputs(batch=1, length=7).items() if k != "attention_mask"}
    cam = inputs.pop("cross_attention_mask")
    text = {"input_ids": inputs["input_ids"][:, 2:]}
    steps, first = [], []
    with torch.inference_mode():
        for kw, mask in ((inputs, cam), (text, None), (inputs, cam)):
            pair = []
            for _ in range(2):
                out = model(**kw, cross_attention_mask=mask, use_cache=True, logits_to_keep=1)
                pair.append(runtime_models.mllama_step(model, out.cache, kw["input_ids"].shape[1] + 6, mask))
            steps.append(pair)
            first.append((int(out.logits[0, -1].argmax()), kw["input_ids"].shape[1]))
        toks, pos = [t for t, _ in first], [n for _, n in first]
        for _ in range(5):
            batch = [lg.clone() for lg in decode_step.step_batch([p[0] for p in steps], toks, pos)]
            for p, tok, at, lg in zip(steps, toks, pos, batch):
                assert torch.equal(p[1].step(tok, at), lg)
            toks, pos = [int(lg.argmax()) for lg in batch], [at + 1 for at in pos]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pipeline.runtime.generation", *map(str, args)], capture_output=True, text=True)


def test_cli_generates_and_reports_tokens_per_s(synth):
    p = _cli(synth["s3d8"], "--prompt", "hello", "--max-new-tokens", "5", "--threads", "1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("<") == 5 and "tokens/s" in p.stderr
    p = _cli(synth["s3d8"], "--prompt", "hello", "--max-new-tokens", "2")      # --threads 0: torch's default
    assert p.returncode == 0 and "thread(s)" in p.stderr, p.stderr


def test_cli_prints_hf_generate_tokens_on_the_synthetic_llama(synth, capsys):
    """The printed tokens are those of Hugging Face generate on the same file and prompt, the stop token not
    printed."""
    model = runtime_models.hf_llama(synth["s3d8"])
    eos = {t for t in runtime_models.LeanLlama(synth["s3d8"], 16).eos if t is not None}
    ids = torch.tensor([[1] + [3 + b for b in b"hello"]])
    with torch.inference_mode():
        ref = model.generate(input_ids=ids, do_sample=False, max_new_tokens=8, eos_token_id=sorted(eos),
                             pad_token_id=0)[0, ids.shape[1]:].tolist()
    ref = [t for t in ref if t not in eos]
    for impl in ("lean", "hf"):
        assert runtime.main([str(synth["s3d8"]), "--prompt", "hello", "--max-new-tokens", "8", "--threads", "1",
                             "--impl", impl]) == 0
        assert capsys.readouterr().out == "".join(f"<{t}>" for t in ref) + "\n"
    # from_pretrained reads a packed Hugging Face directory (tests/test_hf.py); a bare synthetic file is refused
    assert runtime.main([str(synth["s3d8"]), "--prompt", "hello", "--impl", "from_pretrained"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "from_pretrained needs a packed model directory with config.json" in err[0]


def test_cli_takes_a_packed_model_directory(synth, tmp_path):
    model_dir = tmp_path / "packed"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(synth["s3d8"].read_bytes())
    p = _cli(model_dir, "--prompt", "hello", "--max-new-tokens", "3", "--threads", "1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("<") == 3 and "tokens/s" in p.stderr
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "shard-1.safetensors").write_bytes(b"")
    p = _cli(tmp_path / "other", "--prompt", "x")
    assert p.returncode == 1 and "holds model.safetensors; found shard-1.safetensors" in p.stderr


def test_cli_bad_input_is_one_line(synth, tmp_path, packed_toy):
    """Errors: one line on stderr, exit status 1 (2 is argparse's, for a command line it cannot parse)."""
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a model")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(synth["s3d8"].read_bytes()[:-100])
    for args, needle in [((junk, "--prompt", "x"), "not a readable safetensors file"),
                         ((truncated, "--prompt", "x"), f"{truncated}: truncated or corrupt"),
                         ((synth["s3d8"], "--prompt", "x", "--threads", "-2"), "--threads -2"),
                         ((synth["s3d8"].parent / "missing.safetensors", "--prompt", "x"), "no such file"),
                         ((synth["s3d8"], "--prompt", "x" * 600), "exceed the model's context of 512"),
                         ((synth["s3d8"], "--prompt", "x", "--threads", "4096"), "--threads 4096"),
                         ((synth["s3d8"], "--prompt", "x", "--image", junk), "text-only Llama"),
                         ((packed_toy, "--prompt", "x"), "no tokenizer")]:
        p = _cli(*args)
        assert p.returncode == 1, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, p.stderr)


def test_cli_refuses_other_packed_formats(tiny_checkpoint, tmp_path):
    from pipeline.models import load_model, meta_model, quantised_weight_names
    from pipeline.packed.file import write_packed

    reader = CheckpointReader(tiny_checkpoint)
    teacher = load_model(str(tiny_checkpoint), torch.float32)
    names = quantised_weight_names(meta_model(teacher.config))
    fmt = formats.get("int")
    states = {s.removesuffix(".weight"): fmt.fit(reader.get(s)) for s in names.values()}
    out = tmp_path / "int.safetensors"
    write_packed(out, reader, fmt, states, metadata={"config": teacher.config.to_dict()})
    p = _cli(out, "--prompt", "x")
    assert p.returncode == 1 and "not a packed S3D8 model" in p.stderr and "kernel='torch'" in p.stderr


def test_gguf_of_the_synthetic_weights(synth, tmp_path):
    gguf = pytest.importorskip("gguf")
    out = write_gguf(synth["bf16"], tmp_path / "m.gguf")
    r = gguf.GGUFReader(str(out))
    names = {t.name: t for t in r.tensors}
    assert "token_embd.weight" in names and "blk.1.ffn_down.weight" in names and "output.weight" not in names
    assert names["blk.0.attn_q.weight"].tensor_type.name == "BF16"


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
])
def test_rotary_tables_equal_hugging_face_bit_for_bit(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "max_position_embeddings": 131072, **rope}
    hf = LlamaRotaryEmbedding(LlamaConfig(**cfg))
    inv_freq, scaling = runtime_models._rotary(cfg)
    assert torch.equal(inv_freq, hf.inv_freq.float()) and scaling == float(hf.attention_scaling)
    with pytest.raises(runtime_models.RuntimeInputError, match="RoPE type 'yarn'"):
        runtime_models._rotary({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})


def test_c_decode_step_and_row_embedding_refuse_tensors_without_their_bytes():
    """A weight, norm or cache whose storage is gone (a parameter FSDP2 has resharded) or on the meta device is a
    ValueError naming the layer and the tensor when the C decoder is built, and the row embedding refuses a freed
    buffer before torch or C reads it: never a segmentation fault."""
    from pipeline import native
    from pipeline.runtime.decode_step import DecodeStep, rope_tables

    gen = torch.Generator().manual_seed(0)

    def linear(d_out, d_in):
        return native.Bf16Linear(torch.randn(d_out, d_in, generator=gen).to(torch.bfloat16))

    def parts():
        layer = {"ln1": torch.ones(16), "ln2": torch.ones(16), "q": linear(16, 16), "k": linear(8, 16),
                 "v": linear(8, 16), "o": linear(16, 16), "gate": linear(32, 16), "up": linear(32, 16),
                 "down": linear(16, 32), "k_cache": torch.zeros(1, 10, 8), "v_cache": torch.zeros(1, 10, 8)}
        cos, sin_rolled = rope_tables(1.0 / 10000 ** (torch.arange(0, 8, 2) / 8), 1.0, 10)
        return dict(hidden=16, n_heads=2, n_kv_heads=1, head_dim=8, eps=1e-5, layers=[layer], cos=cos,
                    sin_rolled=sin_rolled, embed=native.Bf16RowEmbedding(torch.randn(50, 16).bfloat16()),
                    lm_head=linear(50, 16), norm=torch.ones(16))

    assert DecodeStep(**parts()).step(3, 0).shape == (50,)
    for how in ("freed", "meta"):
        spec = parts()
        spec["layers"][0]["ln2"] = torch.ones(16).to("meta") if how == "meta" else _freed(torch.ones(16))
        with pytest.raises(ValueError, match="^C decoder: layer 0 ln2: "):
            DecodeStep(**spec)
        spec = parts()
        _freed(spec["layers"][0]["up"].weight)
        with pytest.raises(ValueError, match="^C decoder: layer 0 up \\(Bf16Linear\\) buffer 'weight': its storage"):
            DecodeStep(**spec)
        spec = parts()
        _freed(spec["embed"].weight)
        with pytest.raises(ValueError, match="^C decoder: embed \\(Bf16RowEmbedding\\) buffer 'weight'"):
            DecodeStep(**spec)
        spec = parts()
        _freed(spec["layers"][0]["v_cache"])
        with pytest.raises(ValueError, match="^C decoder: layer 0 v_cache: its storage holds 0 bytes"):
            DecodeStep(**spec)

    w = torch.randn(30, 40, generator=gen)
    table = s3d8_format.fit_centroids(w, seed=0, max_vectors=4096)
    packed, scale = s3d8_format.encode(w, table)
    for name in ("packed", "scale", "table"):
        emb = native.S3D8RowEmbedding(packed.clone(), scale.clone(), table.clone(), (30, 40))
        _freed(emb._buffers[name])
        with pytest.raises(ValueError, match=f"^S3D8RowEmbedding buffer '{name}': its storage holds 0 bytes"):
            emb(torch.tensor([1, 2]))


def _freed(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage resized to 0 bytes, as FSDP2 leaves a resharded parameter."""
    t.untyped_storage().resize_(0)
    return t
