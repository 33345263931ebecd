"""KL / top-1 / perplexity of packed files against the float32 teacher, as ``pipeline.bench.real_model`` measures them
(its 55 held-out answers at max_seq_len 160, 8,192 corpus tokens in 512-token windows), without llama.cpp or speed.
Run in the run's workspace (eighteenth session):
    PYTHONPATH=. S3D8_CPU_NUMERICS=native python score.py models/packed/s3d8/direct-cast/model.safetensors ..."""
import sys, os, torch
torch.set_num_threads(2)
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from pipeline import texts
from pipeline.eval import text
from pipeline.teacher.answers import load_examples, split_heldout
from pipeline.bench.real_model import packed_logits_fn
cache = Path("ref.pt")                 # the teacher's side, built once
if cache.exists():
    ref = torch.load(cache, weights_only=False)
else:
    config = AutoConfig.from_pretrained("models/teacher"); tok = AutoTokenizer.from_pretrained("models/teacher")
    _, held = split_heldout(load_examples("data/teacher", config.vocab_size), 64)
    windows = texts.corpus_windows(tok, 8192, 512)
    teacher = AutoModelForCausalLM.from_pretrained("models/teacher", dtype="auto").eval()
    ref = text.TextReference.build(teacher, tok, held, windows, max_seq_len=160)
    print("teacher", ref.score(text.hf_logits_fn(teacher)))
    torch.save(ref, cache)
for p in sys.argv[1:]:
    fn, _ = packed_logits_fn(p)
    s = ref.score(fn)
    print(p, {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}, flush=True)
