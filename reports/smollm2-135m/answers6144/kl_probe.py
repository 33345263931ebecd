"""Per-token KL (teacher || model) of our S3D8 QAT model and variants of it against the float32 rotated teacher on the
bench's held-out answers, by answer position: where the KL above llama.cpp's IQ4_NL+embd sits (twentieth session).
Variants: the packed file as it is; activations left in float (act_quant=False); every layer's attention (q/k/v/o) or
MLP (gate/up/down) put back to the teacher's; the teacher's MLPs in a third of the layers at a time. In the run's
workspace:  PYTHONPATH=. S3D8_CPU_NUMERICS=native python kl_probe.py [NAME-PREFIX ...] > kl_probe.txt
(arguments: run only the variants whose name starts with one of them)
(The comparison with IQ4_NL+embd itself: ../answers3072-steps1200/kl_breakdown.py, same workspace: kl_breakdown.txt.)
"""
import sys

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
BINS = [(0, 4), (4, 16), (16, 32), (32, 48), (48, 10**6)]
L = len(teacher.model.layers)
VARIANTS = {                                  # name: (act_quant, part put back to the teacher's, its layers)
    "as packed": (True, None, ()),
    "float activations": (False, None, ()),
    "teacher's attention": (True, "self_attn", range(L)),
    "teacher's MLPs": (True, "mlp", range(L)),
    **{f"teacher's MLPs, layers {a}-{a + 9}": (True, "mlp", range(a, a + 10)) for a in range(0, L, 10)},
}
print("answer positions", " ".join(f"{a}-{b - 1}" if b < 10**6 else f"{a}+" for a, b in BINS))
for name, (act_quant, part, layers) in VARIANTS.items():
    if sys.argv[1:] and not name.startswith(tuple(sys.argv[1:])):
        continue
    model = load_packed_model(PACKED, act_quant=act_quant, kernel="torch").eval()
    for i in layers:
        setattr(model.model.layers[i], part, getattr(teacher.model.layers[i], part))
    fn = hf_logits_fn(model)
    kl, pos = [], []
    for seq in ref.answers:
        s = fn(seq.ids)[seq.start:len(seq.ids) - 1].float().log_softmax(-1)
        t = seq.teacher.float().log_softmax(-1)
        kl.append((t.exp() * (t - s)).sum(-1)); pos.append(torch.arange(len(kl[-1])))
    kl, pos = torch.cat(kl), torch.cat(pos)
    row = " ".join(f"{kl[(pos >= a) & (pos < b)].mean():.3f}" for a, b in BINS)
    print(f"{name:32s} KL {kl.mean():.4f}  by position {row}", flush=True)
