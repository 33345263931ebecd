"""Fake-quantised modules, prepare, the response-only KL and fitted-state files."""

import pytest
import torch
from torch import nn

from pipeline import formats
from pipeline.qat.api import prepare
from pipeline.recipe import quantised_modules
from pipeline.divergence import response_kl_sum
from pipeline.qat.modules import QuantEmbedding, QuantLinear
from pipeline.quant import fake_quant_activations


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.conv = nn.Conv2d(3, 4, 2)
        self.proj = nn.Linear(32, 7)
        self.norm = nn.LayerNorm(7)


def fitted(model, fmt):
    return {name: formats.get(fmt).fit(m.weight.detach()) for name, m in quantised_modules(model)}


@pytest.mark.parametrize("fmt", ["s3d8", "int", "student_t", "lloyd_max", "int8", "bf16"])
def test_prepare_swaps_linear_and_embedding_only(fmt):
    torch.manual_seed(0)
    model = Tiny()
    names = prepare(model, formats.get(fmt), fitted(model, fmt))
    assert names == ["embed", "proj"]
    assert isinstance(model.proj, QuantLinear) and isinstance(model.embed, QuantEmbedding)
    assert isinstance(model.conv, nn.Conv2d) and isinstance(model.norm, nn.LayerNorm)
    assert set(model.state_dict()) == set(Tiny().state_dict()), "checkpoint layout unchanged"


def test_quant_linear_forward_is_quantised_weight_and_int8_activations():
    torch.manual_seed(0)
    model = Tiny()
    states = fitted(model, "s3d8")
    w = model.proj.weight.detach().clone()
    prepare(model, formats.get("s3d8"), states, act_quant=True)
    x = torch.randn(5, 32)
    wq = formats.get("s3d8").quantize(w, states["proj"])
    want = torch.nn.functional.linear(fake_quant_activations(x), wq, model.proj.bias)
    assert torch.equal(model.proj(x), want)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.embed(ids), formats.get("s3d8").quantize(model.embed.weight, states["embed"])[ids])


def test_gradient_reaches_the_master_weights():
    torch.manual_seed(0)
    model = Tiny()
    prepare(model, formats.get("s3d8"), fitted(model, "s3d8"))
    out = model.proj(model.embed(torch.tensor([1, 2])))
    out.sum().backward()
    assert model.proj.weight.grad is not None and model.proj.weight.grad.abs().sum() > 0
    assert model.embed.weight.grad is not None and model.embed.weight.grad.abs().sum() > 0


def test_missing_state_names_the_module():
    model = Tiny()
    states = fitted(model, "s3d8")
    del states["proj"]
    with pytest.raises(ValueError, match="'proj'"):
        prepare(model, formats.get("s3d8"), states)


def test_response_kl_counts_only_masked_positions():
    torch.manual_seed(0)
    t = torch.randn(2, 4, 11)
    s = torch.randn(2, 4, 11)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0]])
    total = response_kl_sum(s, t, mask)
    pt, ls = t.softmax(-1), s.log_softmax(-1)
    manual = sum(float((pt[b, i] * (pt[b, i].log() - ls[b, i])).sum()) for b, i in [(0, 1), (0, 2), (1, 2)])
    assert total.item() == pytest.approx(manual, rel=1e-5)
    assert response_kl_sum(t, t, mask).item() == pytest.approx(0.0, abs=1e-6)
    s2 = s.clone()
    s2[0, 0] += 100           # unmasked positions do not matter
    assert response_kl_sum(s2, t, mask).item() == pytest.approx(total.item(), rel=1e-6)


@pytest.mark.parametrize("chunk", [1, 24, 1 << 20])      # a block per row, blocks across rows, one block
def test_kl_in_blocks_is_kl_div_and_its_gradient(monkeypatch, chunk):
    """kl_sum runs over row blocks with its own backward: the value and the student's gradient are those of
    kl_div(log_softmax(s), log_softmax(t), log_target=True) and autograd, to float32 rounding, for a bf16
    teacher and any block size; the teacher gets no gradient."""
    import torch.nn.functional as F

    import pipeline.divergence as divergence

    monkeypatch.setattr(divergence, "CHUNK", chunk)
    torch.manual_seed(0)
    s = (torch.randn(37, 11) * 4).requires_grad_()
    t = (torch.randn(37, 11) * 4).bfloat16().requires_grad_()
    ref = F.kl_div(F.log_softmax(s.float(), -1), F.log_softmax(t.float(), -1), log_target=True, reduction="sum")
    (g_ref,) = torch.autograd.grad(ref * 0.5, s)
    kl = divergence.kl_sum(s, t)
    assert kl.dtype == torch.float32
    assert float(kl) == pytest.approx(float(ref), rel=1e-6)
    (kl * 0.5).backward()
    assert torch.allclose(s.grad, g_ref, rtol=0, atol=1e-6)
    assert t.grad is None
    assert float(divergence.kl_sum(t.float().detach(), t)) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_rows_give_the_logits_at_the_kept_positions(dtype):
    """head_rows runs the output head on the kept positions only: the same rows as the full logits[keep], in the
    same order (the head's product over fewer rows: to float rounding), a gradient through them, and the hook gone
    after the block."""
    from pipeline.teacher.answers import collate
    from pipeline.teacher.logits import head_rows, model_logits

    model, processor = _toy(dtype)
    batch = collate([e for e in _toy_examples(3)], processor, 160)
    keep = batch["loss_mask"].bool()
    full = model_logits(model, batch)[keep]
    rows = model_logits(model, batch, keep=keep)
    assert rows.shape == full.shape == (int(keep.sum()), model.config.text_config.vocab_size)
    tol = 1e-5 if dtype == torch.float32 else 0.07
    assert torch.allclose(rows.float(), full.float(), rtol=0, atol=tol)
    assert not model.get_output_embeddings()._forward_pre_hooks
    inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
    model.float().train()
    with head_rows(model, keep):
        out = model(**inputs).logits
    out.sum().backward()
    assert model.get_output_embeddings().weight.grad is not None


def test_states_round_trip(tmp_path):
    model = Tiny()
    states = fitted(model, "student_t")
    formats.get("student_t").save_states(tmp_path / "st.safetensors", states, {"seed": 0})
    first = (tmp_path / "st.safetensors").read_bytes()
    formats.get("student_t").save_states(tmp_path / "st.safetensors", states, {"seed": 0})
    assert (tmp_path / "st.safetensors").read_bytes() == first          # byte-reproducible
    back = formats.get("student_t").load_states(tmp_path / "st.safetensors")
    assert back.keys() == states.keys()
    assert all(torch.equal(back[m][k], states[m][k]) for m in states for k in states[m])
    with pytest.raises(ValueError, match="not 's3d8'"):
        formats.get("s3d8").load_states(tmp_path / "st.safetensors")
    empty = {name: {} for name in states}
    formats.get("bf16").save_states(tmp_path / "bf16.safetensors", empty)
    assert formats.get("bf16").load_states(tmp_path / "bf16.safetensors") == empty


# --- learned scales and the post-training start (qat.learn_scales, qat.init: ptq) ------------------------

@pytest.mark.parametrize("fmt", ["s3d8", "int", "student_t", "lloyd_max"])
def test_learned_scale_forward_is_what_the_packer_writes(fmt):
    """The fake-quant forward at a trained scale equals unpacking fmt.pack_at_scale at its bf16 rounding, bit for
    bit; at the absmax scale it equals the format's own quantize; both the weight and the scale get gradients."""
    from pipeline.qat.modules import learned_scale, log2_scale, quantize_learned

    torch.manual_seed(0)
    w = (torch.randn(31, 200) * torch.rand(31, 1)).requires_grad_()
    state = formats.get(fmt).fit(w.detach())
    absmax = formats.get(fmt).absmax_scale(w.detach())
    assert torch.equal(learned_scale(log2_scale(absmax)), absmax)
    assert torch.equal(quantize_learned(formats.get(fmt), w.detach(), state, log2_scale(absmax)),
                       formats.get(fmt).quantize(w.detach(), state))
    scale = torch.nn.Parameter(log2_scale(absmax) - 0.37)
    q = quantize_learned(formats.get(fmt), w, state, scale)
    packed = formats.get(fmt).pack_at_scale(w, state, learned_scale(scale))
    assert torch.equal(q, formats.get(fmt).unpack(packed, tuple(w.shape)))
    q.pow(2).sum().backward()
    assert scale.grad is not None and scale.grad.abs().sum() > 0 and w.grad.abs().sum() > 0


def test_prepare_with_scales_adds_a_parameter_outside_the_checkpoint_layout():

    torch.manual_seed(0)
    model = Tiny()
    scales = {n: formats.get("s3d8").absmax_scale(m.weight.detach()) for n, m in quantised_modules(model)}
    prepare(model, formats.get("s3d8"), fitted(model, "s3d8"), scales=scales)
    extra = set(model.state_dict()) - set(Tiny().state_dict())
    assert extra == {"proj.qat_log2_scale", "embed.qat_log2_scale"}
    assert model.proj.qat_log2_scale.shape == (7, 1) and model.proj.qat_log2_scale.requires_grad


@pytest.mark.parametrize("fmt", ["s3d8", "student_t"])
def test_ptq_start_is_the_direct_cast(fmt):
    """qat.init ptq: the student's first forward weight is exactly the direct cast the packer writes (gptq on a
    Hessian), with the learned scale starting at that cast's scale."""
    from pipeline.cast import ptq
    from pipeline.qat.modules import learned_scale
    from pipeline.params import defaults
    from pipeline.qat.train import QATParams, quantise_student

    torch.manual_seed(0)
    model = Tiny()
    teacher = {n: m.weight.detach().clone() for n, m in quantised_modules(model)}
    x = torch.randn(64, 32)
    hessian = {"proj": x.T @ x / 64}
    states = {n: formats.get(fmt).fit(w) for n, w in teacher.items()}
    start = lambda name, w: ptq.start(formats.get(fmt), w, algorithm="gptq", hessian=hessian.get(name))  # noqa: E731
    names = {}
    quantise_student(model, formats.get(fmt), states, defaults(QATParams, "qat", init="ptq", learn_scales=True), start, names)
    assert names == {"embed": "embed.weight", "proj": "proj.weight"}
    for name, w in teacher.items():
        want = ptq.direct_cast(formats.get(fmt), w, algorithm="gptq", hessian=hessian.get(name))
        assert torch.equal(model.get_submodule(name).quantized_weight().detach(), want), name
        # the master is the weight the algorithm rounded, not the decoded one (a cell centre QAT cannot leave)
        assert float((model.get_submodule(name).weight.detach() != want).float().mean()) > 0.9, name
        tensors = ptq.pack(formats.get(fmt), w, algorithm="gptq", hessian=hessian.get(name))
        assert torch.equal(learned_scale(model.get_submodule(name).qat_log2_scale), tensors["scale"])


def test_qat_init_is_checked():
    from pipeline import params
    from pipeline.qat.train import QATParams

    with pytest.raises(params.ParamsError, match="qat.init"):
        params.defaults(QATParams, "qat", init="random")


def test_held_out_answers_leave_out_prompts_the_training_answers_also_have():
    """A prompt drawn twice from the pool (once among the training answers, once among the last ``heldout``) is not
    scored: the student was trained on the teacher's distribution for that very prompt."""
    from pipeline.teacher.answers import Example, split_heldout

    ex = [Example(i, ref, ids, (9, i)) for i, (ref, ids) in enumerate(
        [(None, (1, 2)), ("img-a", (3,)), (None, (4,)), (None, (1, 2)), ("img-b", (3,)), (None, (5,))])]
    train, held = split_heldout(ex, 3)
    assert train == ex[:3]
    assert [e.index for e in held] == [4, 5]           # prompt 3 repeats prompt 0; 4 has another image than 1
    assert split_heldout(ex, 0) == (ex, [])
    with pytest.raises(ValueError, match="heldout_prompts=6"):
        split_heldout(ex, 6)


def test_group_by_length_batches_pad_less_and_still_visit_every_example_once_an_epoch():
    """qat.group_by_length: each epoch is the same permutation's examples, megabatches sorted longest first; the
    plain draw is unchanged (a pure function of step and seed, as resuming needs)."""
    from pipeline.teacher.answers import GROUP_BY_LENGTH_BATCHES, batch_indices

    n, bs = 1000, 8
    lengths = [192 if i % 4 == 0 else 40 + (i * 37) % 90 for i in range(n)]        # windows beside answers
    steps = n // bs
    plain = [batch_indices(n, bs, s, seed=3) for s in range(steps)]
    grouped = [batch_indices(n, bs, s, seed=3, lengths=lengths) for s in range(steps)]
    assert sorted(i for b in grouped for i in b) == list(range(n))
    mega = GROUP_BY_LENGTH_BATCHES * bs
    flat_plain, flat_grouped = [i for b in plain for i in b], [i for b in grouped for i in b]
    for a in range(0, n, mega):
        assert sorted(flat_plain[a:a + mega]) == sorted(flat_grouped[a:a + mega])
        assert [lengths[i] for i in flat_grouped[a:a + mega]] == sorted((lengths[i] for i in flat_plain[a:a + mega]),
                                                                        reverse=True)
    padded = lambda batches: sum(len(b) * max(lengths[i] for i in b) for b in batches)      # noqa: E731
    assert padded(grouped) < 0.8 * padded(plain)
    assert batch_indices(n, bs, steps + 5, seed=3, lengths=lengths) != grouped[5]    # the next epoch: a new order
    assert batch_indices(n, bs, 7, seed=3) == plain[7]


def _toy_examples(n: int, seed: int = 0):
    """Training sequences for the committed toy teacher: prompts with its image token, varied lengths."""
    import random

    from pipeline.teacher.answers import Example

    rng = random.Random(seed)
    return [Example(i, f"toy:{i}:0", (0, 1202, *(rng.randrange(10, 1200) for _ in range(rng.randrange(3, 12)))),
                    tuple(rng.randrange(10, 1200) for _ in range(rng.randrange(2, 9))) + (9,)) for i in range(n)]


def _toy(dtype):
    import pipeline.toy  # noqa: F401  (the toy image pool)
    from pipeline.models import load_model, load_processor

    return load_model("data/toy-teacher", dtype), load_processor("data/toy-teacher")


def test_cached_teacher_logits_give_the_per_step_kl_and_gradients():
    """qat.teacher_logits cache: the rows computed once (other batches, other padding) are the per-step
    forward's to bf16 rounding, and the KL and the student's gradients agree to 1e-3 relative."""
    from pipeline.teacher.answers import collate
    from pipeline.divergence import kl_sum
    from pipeline.teacher.logits import TeacherLogits

    teacher, processor = _toy(torch.bfloat16)
    examples = _toy_examples(6)
    cache = TeacherLogits(teacher, torch.bfloat16, examples, processor, 160, 4, "cpu")
    assert [cache[i].shape[0] for i in range(6)] == [len(e.response_ids) for e in examples]
    assert all(cache[i].dtype == torch.bfloat16 for i in range(6))
    picked = [5, 1, 2]                              # another composition and padding than the cache's batches
    batch = collate([examples[i] for i in picked], processor, 160)
    per_step = TeacherLogits(teacher, torch.bfloat16).rows(batch)                   # the forward, no cache
    keep = batch.pop("loss_mask").bool()
    cached = cache.rows(batch, picked)
    assert cached.shape == per_step.shape
    assert torch.allclose(cached.float(), per_step.float(), rtol=0, atol=0.07)   # a few bf16 ulps of |logit| < 16

    student, _ = _toy(torch.float32)
    results = []
    for t in (per_step, cached):
        student.zero_grad(set_to_none=True)
        kl = kl_sum(student(**batch).logits[keep], t)
        kl.backward()
        results.append((kl.detach(), torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])))
    (kl_a, g_a), (kl_b, g_b) = results
    assert float(kl_a) > 0
    assert abs(float(kl_a - kl_b)) <= 1e-3 * float(kl_a)
    assert float((g_a - g_b).norm()) <= 1e-3 * float(g_a.norm())


@pytest.mark.parametrize("threads", [1, pytest.param(2, marks=pytest.mark.slow)])   # 2: ~1 s alone, 30 s on a busy core
def test_qat_steps_give_the_same_bytes_at_one_thread_count(threads):
    """Same parameters and seeds, same thread count: the same student bytes (a fixed reduction order)."""
    from pipeline.teacher.answers import collate
    from pipeline.divergence import kl_sum
    from pipeline.teacher.logits import TeacherLogits

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        teacher, processor = _toy(torch.bfloat16)
        examples = _toy_examples(4)
        states = fitted(_toy(torch.float32)[0], "int")
        runs = []
        for _ in range(2):
            cache = TeacherLogits(teacher, torch.bfloat16, examples, processor, 160, 2, "cpu")
            student, _ = _toy(torch.float32)
            prepare(student, formats.get("int"), states)
            optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
            for picked in ([0, 3], [2, 1]):
                batch = collate([examples[i] for i in picked], processor, 160)
                keep = batch.pop("loss_mask").bool()
                kl_sum(student(**batch).logits[keep], torch.cat([cache[i] for i in picked])).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            runs.append({k: v.detach().clone() for k, v in student.state_dict().items()})
        assert runs[0].keys() == runs[1].keys()
        for k in runs[0]:
            assert torch.equal(runs[0][k], runs[1][k]), k
    finally:
        torch.set_num_threads(before)


def test_fake_quant_stays_fp32_under_autocast_and_bf16_inputs():
    """The quantiser and the learned scale run in float32 whatever the compute dtype; only the product is bf16."""

    torch.manual_seed(0)
    linear = nn.Linear(96, 48, bias=True)
    fmt = formats.get("s3d8")
    module = QuantLinear(linear, fmt, fmt.fit(linear.weight.detach()), act_quant=True,
                         scale=formats.get("s3d8").absmax_scale(linear.weight.detach()))
    want = module.quantized_weight()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = module.quantized_weight()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    x = torch.randn(5, 96)
    out = module(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), module(x), rtol=2e-2, atol=2e-2)


def test_tied_modules_get_one_post_training_start():
    """A tied lm_head shares embed_tokens' weight: one start for both (a second one, computed from the first's
    master, gave the two modules different tables and moved the shared weight: SmolLM2's first QAT KL was 3.19
    instead of its direct cast's 1.2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.cast import ptq
    from pipeline.models import quantised_weight_names
    from pipeline.params import defaults
    from pipeline.qat.train import QATParams, quantise_student

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                         tie_word_embeddings=True))
    fmt = formats.get("s3d8")
    embed = model.model.embed_tokens.weight.detach().clone()
    names = quantised_weight_names(model)
    states = {saved.removesuffix(".weight"): fmt.fit(model.get_submodule(m).weight.detach())
              for m, saved in names.items()}
    calls = []

    def start(name, w):
        calls.append(name)
        return ptq.start(formats.get("s3d8"), w, algorithm="search")

    quantise_student(model, fmt, states, defaults(QATParams, "qat", init="ptq", learn_scales=True), start, {})
    assert len(calls) == len(set(calls)) == len(states)
    head, emb = model.lm_head, model.model.embed_tokens
    assert head.weight is emb.weight and torch.equal(head.qstate["table"], emb.qstate["table"])
    assert torch.equal(head.quantized_weight(), ptq.direct_cast(formats.get("s3d8"), embed, algorithm="search"))
