"""Per-token KL of ours (S3D8 QAT, activations INT8 per token as packed) and the same file with activations left in
float (act_quant=False) against the float32 rotated teacher on the bench's 54 held-out answers, by teacher entropy and
by position (kl_breakdown.py with the llama.cpp file swapped out; twentieth session). In the run's workspace:
    PYTHONPATH=. S3D8_CPU_NUMERICS=native python kl_actquant.py > kl_actquant.txt
"""
import torch
from pipeline.bench.real_model import packed_logits_fn
torch.set_num_threads(2)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from pipeline.eval import text
from pipeline.teacher.answers import load_examples, split_heldout
config = AutoConfig.from_pretrained("models/teacher"); tok = AutoTokenizer.from_pretrained("models/teacher")
_, held = split_heldout(load_examples("data/teacher", config.vocab_size), 64)
teacher = AutoModelForCausalLM.from_pretrained("models/teacher", dtype="auto").eval()
print("teacher dtype", teacher.dtype)
ref = text.TextReference.build(teacher, tok, held, [], max_seq_len=160)
del teacher
def per_token(fn):
    out = []
    for seq in ref.answers:
        s = fn(seq.ids)[seq.start:len(seq.ids) - 1].float().log_softmax(-1)
        t = seq.teacher.float().log_softmax(-1)
        out.append(((t.exp() * (t - s)).sum(-1), -(t.exp() * t).sum(-1)))
    return out
ours_fn, _ = packed_logits_fn("models/packed/s3d8/qat/model.safetensors")
ours = per_token(ours_fn)
print("ours done", flush=True)
fp_fn, _ = packed_logits_fn("models/packed/s3d8/qat/model.safetensors", act_quant=False)
iq = per_token(fp_fn)
a = torch.cat([k for k, _ in ours]); b = torch.cat([k for k, _ in iq]); h = torch.cat([e for _, e in ours])
pos = torch.cat([torch.arange(len(k)) for k, _ in ours])
print("tokens", len(a), "KL ours", a.mean().item(), "ours-float-activations", b.mean().item())
q = torch.quantile(h, torch.tensor([0.25, 0.5, 0.75]))
bins = [("entropy<q25", h <= q[0]), ("q25-q50", (h > q[0]) & (h <= q[1])), ("q50-q75", (h > q[1]) & (h <= q[2])), ("q75+", h > q[2])]
bins += [("answer pos 0-3", pos < 4), ("4-15", (pos >= 4) & (pos < 16)), ("16-31", (pos >= 16) & (pos < 32)),
         ("32-47", (pos >= 32) & (pos < 48)), ("48+", pos >= 48)]
absolute = torch.cat([torch.arange(len(k)) + seq.start + 1 for (k, _), seq in zip(ours, ref.answers)])
bins += [("sequence pos <48", absolute < 48), ("48-79", (absolute >= 48) & (absolute < 80)), ("80+", absolute >= 80)]
# sequence and answer position go together (the prompts are 40-100 tokens): split one by the other
bins += [("ans<16 & seq<80", (pos < 16) & (absolute < 80)), ("ans<16 & seq80+", (pos < 16) & (absolute >= 80)),
         ("ans16+ & seq<80", (pos >= 16) & (absolute < 80)), ("ans16+ & seq80+", (pos >= 16) & (absolute >= 80))]
for name, m in bins:
    print(f"{name:17s} n={int(m.sum()):5d} ours {a[m].mean():.3f} floatact {b[m].mean():.3f} share of ours' excess {((a-b)[m].sum()/(a-b).sum()):.2f}")
for frac in (0.01, 0.05, 0.2):
    k = int(frac * len(a))
    print(f"top {frac:.0%} tokens hold ours {a.topk(k).values.sum()/a.sum():.2f} of its KL, floatact {b.topk(k).values.sum()/b.sum():.2f}")
per_answer = torch.tensor([(k1.mean() - k2.mean()).item() for (k1, _), (k2, _) in zip(ours, iq)])
print("answers where ours is worse:", int((per_answer > 0).sum()), "of", len(per_answer))
