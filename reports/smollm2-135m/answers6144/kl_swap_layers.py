"""Per-token KL of our S3D8 QAT model with the MLPs of a third of the decoder layers put back to the float32 (rotated)
teacher's, against the teacher on the bench's 54 held-out
answers, by answer position: which matrices carry the KL's rise along an answer (twentieth session). In the run's
workspace:  PYTHONPATH=. S3D8_CPU_NUMERICS=native python kl_swap_layers.py > kl_swap_layers.txt
"""
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from pipeline.eval import text
from pipeline.eval.text import hf_logits_fn
from pipeline.packed.file import load_packed_model
from pipeline.teacher.answers import load_examples, split_heldout
torch.set_num_threads(2)
config = AutoConfig.from_pretrained("models/teacher"); tok = AutoTokenizer.from_pretrained("models/teacher")
_, held = split_heldout(load_examples("data/teacher", config.vocab_size), 64)
teacher = AutoModelForCausalLM.from_pretrained("models/teacher", dtype="auto").eval()
ref = text.TextReference.build(teacher, tok, held, [], max_seq_len=160)
PACKED = "models/packed/s3d8/qat/model.safetensors"


def per_token(fn):
    kl, pos = [], []
    for seq in ref.answers:
        s = fn(seq.ids)[seq.start:len(seq.ids) - 1].float().log_softmax(-1)
        t = seq.teacher.float().log_softmax(-1)
        k = (t.exp() * (t - s)).sum(-1)
        kl.append(k); pos.append(torch.arange(len(k)))
    return torch.cat(kl), torch.cat(pos)


bins = [(0, 4), (4, 16), (16, 32), (32, 48), (48, 10**6)]
print("answer position bins:", bins)
for first, last in [(0, 10), (10, 20), (20, 30)]:
    model = load_packed_model(PACKED, act_quant=True, kernel="torch").eval()
    for i in range(first, last):
        model.model.layers[i].mlp = teacher.model.layers[i].mlp
    kl, pos = per_token(hf_logits_fn(model))
    row = [f"{kl[(pos >= a) & (pos < b)].mean():.3f}" for a, b in bins]
    print(f"teacher's MLPs in layers {first}-{last - 1}: KL {kl.mean():.4f} by position {' '.join(row)}", flush=True)
