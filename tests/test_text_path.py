"""The text-only Llama path (issue 25) stage by stage on a tiny Llama teacher imported from a GGUF: prompts,
teacher answers, training batches, FSDP2 units, the text evaluation (KL, agreement, perplexity) and the corpus."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_teacher_import import byte_vocabulary, tiny_llama, write_tiny_llama_gguf  # noqa: E402

from pipeline.eval import text  # noqa: E402
from pipeline import texts  # noqa: E402
from pipeline.teacher.answers import Example, collate, load_examples, model_inputs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    from pipeline.teacher.importer import import_teacher

    root = tmp_path_factory.mktemp("text")
    vocab = byte_vocabulary()
    gguf_path = write_tiny_llama_gguf(root / "tiny.gguf", tiny_llama(vocab_size=len(vocab)), tokens=vocab)
    import_teacher(str(gguf_path), root / "teacher")
    return root / "teacher"


@pytest.fixture(scope="module")
def tokenizer(teacher_dir):
    from pipeline.models import load_processor

    return load_processor(str(teacher_dir))


@pytest.fixture(scope="module")
def teacher(teacher_dir):
    from pipeline.models import load_model

    return load_model(str(teacher_dir), torch.bfloat16)


def test_text_teacher_has_a_tokenizer_and_text_templates(tokenizer):
    from pipeline.chat import chat_prompt, is_text_only, plain_prompt, tokenizer_of

    assert is_text_only(tokenizer) and tokenizer_of(tokenizer) is tokenizer
    assert chat_prompt(tokenizer, "Explain tides.") == "<|im_start|>user\nExplain tides.<|im_end|>\n<|im_start|>assistant\n"
    assert plain_prompt(tokenizer, "Explain tides.") == "Explain tides.\n"      # this tokenizer adds no BOS


def test_sample_and_generate_text_prompts(tmp_path, teacher_dir, tokenizer):
    from pipeline.teacher import generate_answers as generate
    from pipeline.params import defaults
    from pipeline.teacher.sample import SampleParams, sample_prompts
    from pipeline.files.shards import read_shard
    from pipeline.teacher.source import TeacherParams

    tp = defaults(TeacherParams, "teacher", source="unused", dir=str(teacher_dir), name="tiny")
    p = defaults(SampleParams, "sample", n_prompts=6, shard_size=3, images="no-such-pool",
                 pool=str(REPO / "data/prompts/text_pool.yaml"))
    stats = sample_prompts(p, tp, tmp_path / "sampled")
    assert stats["prompts"] == 6 and stats["shards"] == 2
    table, _ = read_shard(tmp_path / "sampled/shard-00000.parquet")
    rows = table.to_pylist()
    assert all(r["image_ref"] is None for r in rows)
    assert all("<|image|>" not in r["prompt"] for r in rows)
    assert any(r["prompt"].startswith("<|im_start|>user\n") for r in rows)
    gp = defaults(generate.GenerateParams, "generate", batch_size=2, max_new_tokens=4)
    out = generate.run(gp, tp, tmp_path / "sampled", tmp_path / "answers", work=tmp_path / "work")
    assert out                                           # diversity statistics of the answers
    examples = load_examples(tmp_path / "answers", len(tokenizer))
    assert len(examples) == 6 and all(e.image_ref is None and e.prompt_ids for e in examples)
    assert all(len(e.response_ids) <= 4 for e in examples)


def test_collate_text_batches_have_no_image_inputs(tokenizer):
    examples = [Example(0, None, (5, 6, 7), (8, 9)), Example(1, None, (5, 6), (10,))]
    batch = collate(examples, tokenizer, max_seq_len=16)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert set(model_inputs(batch, torch.bfloat16)) == {"input_ids", "attention_mask"}
    with pytest.raises(ValueError, match="prompt 3: an image reference, but the teacher is a text-only model"):
        collate([Example(3, "toy:0:1", (5, 6), (7,))], tokenizer, max_seq_len=16)


def test_qat_corpus_windows_distill_every_token_after_the_first(teacher_dir, tokenizer):
    """qat.corpus_windows: windows of the corpus' calibration half, every later token in the loss; refused for an
    image-text teacher and beyond the corpus."""
    import dataclasses

    from pipeline.params import load
    from pipeline.teacher.answers import text_examples
    from pipeline.qat.train import QATParams
    from pipeline.qat.run import corpus_examples

    p = dataclasses.replace(load(QATParams, "qat", REPO / "params.yaml"), corpus_windows=3, max_seq_len=32)
    examples = corpus_examples(p, str(teacher_dir), 100)
    assert [e.index for e in examples] == [100, 101, 102]
    bos = tokenizer("")["input_ids"]
    rest = tokenizer(text.corpus_text("rest"), add_special_tokens=False)["input_ids"]
    assert [list(e.prompt_ids + e.response_ids) for e in examples] == [
        bos + rest[i * (32 - len(bos)):(i + 1) * (32 - len(bos))] for i in range(3)]
    batch = collate(examples, tokenizer, max_seq_len=32)
    assert batch["loss_mask"].tolist() == [[1] * 31 + [0]] * 3
    assert corpus_examples(dataclasses.replace(p, corpus_windows=0), str(teacher_dir), 0) == []
    both = corpus_examples(dataclasses.replace(p, corpus_source="corpus+english"), str(teacher_dir), 100)
    assert [e.index for e in both] == list(range(100, 106))
    assert [list(e.prompt_ids + e.response_ids) for e in both[:3]] == [
        list(e.prompt_ids + e.response_ids) for e in examples]
    assert [list(e.prompt_ids + e.response_ids) for e in both[3:]] == text.text_windows(
        texts.read("english"), tokenizer, 3, 32, "")
    with pytest.raises(ValueError, match=r"qat.corpus_source='corpus\+web': 'web' is not corpus, english or file"):
        dataclasses.replace(p, corpus_source="corpus+web")
    with pytest.raises(ValueError, match="qat.corpus_source: .*none.txt: no such file"):
        corpus_examples(dataclasses.replace(p, corpus_source="file:/nonexistent/none.txt"), str(teacher_dir), 0)
    with pytest.raises(ValueError, match=r"qat.corpus_windows=100000: the corpus' calibration half holds \d+ windows"):
        corpus_examples(dataclasses.replace(p, corpus_windows=100_000), str(teacher_dir), 0)
    with pytest.raises(ValueError, match="text window 1: fewer than 2 tokens"):
        text_examples([[1, 2], [3]], 0)
    toy = REPO / "data" / "toy-teacher"
    if toy.is_dir():
        with pytest.raises(ValueError, match="qat.corpus_windows=3: needs a text-only teacher"):
            corpus_examples(p, str(toy), 0)


def test_fsdp2_units_of_a_llama_are_its_decoder_layers(teacher):
    from pipeline.models import sharding_units

    names = [n for n, _ in sharding_units(teacher)]
    assert names == ["model.layers.0", "model.layers.1", "model.embed_tokens"]     # tied: lm_head shares it


def test_text_reference_scores(teacher, tokenizer):
    examples = [Example(0, None, (40, 41, 42), (43, 44, 2)), Example(1, None, (50, 51), (52, 53))]
    windows = [[70, 71, 72, 73, 74], [75, 76, 77]]
    ref = text.TextReference.build(teacher, tokenizer, examples, windows)
    with torch.inference_mode():                         # the rows a plain unpadded forward gives, bit for bit
        for e, seq in zip(examples, ref.answers):
            ids = list(e.prompt_ids + e.response_ids)
            plain = teacher(input_ids=torch.tensor([ids])).logits[0, len(e.prompt_ids) - 1:len(ids) - 1]
            assert torch.equal(seq.teacher, plain)
    own = ref.score(text.hf_logits_fn(teacher))
    assert own["kl"] == pytest.approx(0, abs=1e-6) and own["top1_agreement"] == 1
    assert own["kl_tokens"] == 3 + 2 and own["perplexity_tokens"] == 4 + 2
    with torch.inference_mode():                         # perplexity by hand
        nll = []
        for w in windows:
            logp = torch.log_softmax(teacher(input_ids=torch.tensor([w])).logits[0, :-1].float(), -1)
            nll += (-logp[torch.arange(len(w) - 1), torch.tensor(w[1:])]).tolist()
    assert own["perplexity"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-6)

    def noisy(ids):                                      # another model: the teacher's logits plus noise
        gen = torch.Generator().manual_seed(len(ids))
        logits = text.hf_logits_fn(teacher)(ids)
        return logits + 3 * torch.randn(logits.shape, generator=gen)
    other = ref.score(noisy)
    assert other["kl"] > 0.1 and other["top1_agreement"] < 1 and other["perplexity"] != own["perplexity"]


def test_corpus_is_prose_split_and_pinned(tokenizer):
    held, rest = text.corpus_text("heldout"), text.corpus_text("rest")
    assert len(held) > 50_000 and len(rest) > 50_000
    assert not any(line.startswith((" ", "\t")) or set(line) <= set("*=-^~ ") for line in held.split("\n"))
    info = text.corpus_info()
    assert info["chars"] == len(held) and len(info["sha256"]) == 64
    windows = text.corpus_windows(tokenizer, 300, 128)
    assert [len(w) for w in windows] == [128, 128, 44]
    assert tokenizer.decode(sum(windows, [])) == tokenizer.decode(tokenizer(held, add_special_tokens=False)["input_ids"][:300])
    with pytest.raises(ValueError, match="fewer than n_tokens"):
        text.corpus_windows(tokenizer, 10 ** 9, 128)
    with pytest.raises(ValueError, match="corpus split"):
        text.corpus_text("train")
