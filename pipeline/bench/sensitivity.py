"""Where a packed text model's loss is: each decoder layer, each kind of matrix, the head and the embedding put back
to the teacher's weights one group at a time, and the held-out KL and perplexity measured again.

    python -m pipeline.bench.sensitivity --packed models/packed/s3d8/qat --out reports/smollm2-135m/sensitivity

The student is loaded as the eval stage loads it (``load_packed_model``, torch kernels, INT8 activations); a group
"put back" is its Linears (or the embedding) replaced by the teacher's own modules, float32 and without activation
rounding. The teacher is the packed model's source (``--teacher``, default params.yaml ``teacher.dir``: for the
SmolLM2 preset the rotated float32 teacher). What a group recovers (``kl_recovered``: the student's KL minus the
KL with the group put back) is the loss its quantisation carries there; the groups overlap (a layer's
``down_proj`` is in "layer 11" and in "down_proj"), so the recoveries do not sum to the whole. The base of a
sensitivity-driven precision plan: where a bit spent buys the most.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import torch
from torch import nn

from pipeline.files.atomic import write_json, write_text
from pipeline.recipe import replace

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def groups(student: nn.Module) -> dict[str, list[str]]:
    """Group name -> module names: ``layer i`` (its seven Linears), each kind across layers, ``lm_head``,
    ``embed_tokens``."""
    names = [n for n, m in student.named_modules() if re.search(r"\.layers\.\d+\.(self_attn|mlp)\.\w+_proj$", n)]
    layers: dict[str, list[str]] = {}
    for n in names:
        i = int(re.search(r"\.layers\.(\d+)\.", n).group(1))
        layers.setdefault(f"layer {i}", []).append(n)
    out = dict(sorted(layers.items(), key=lambda kv: int(kv[0].split()[1])))
    out.update({k: [n for n in names if n.endswith(k)] for k in KINDS})
    out["lm_head"] = ["lm_head"]
    out["embed_tokens"] = [n for n, _ in student.named_modules() if n.endswith("embed_tokens")]
    return out


def measure(packed: Path, teacher_dir: Path, teacher_data: str, heldout: int, max_seq_len: int, ppl_tokens: int,
            ppl_window: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline import texts
    from pipeline.eval import text
    from pipeline.packed.file import load_packed_model
    from pipeline.teacher.answers import load_examples, split_heldout
    from pipeline.stage import console, progress

    tokenizer = AutoTokenizer.from_pretrained(str(teacher_dir))
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    _, held = split_heldout(load_examples(teacher_data, teacher.config.vocab_size), heldout)
    windows = texts.corpus_windows(tokenizer, ppl_tokens, ppl_window)
    reference = text.TextReference.build(teacher, tokenizer, held, windows, max_seq_len=max_seq_len)
    student = load_packed_model(packed, kernel="torch").eval()
    console.print(f"sensitivity: {packed} against {teacher_dir}")
    with progress() as bar:
        task = bar.add_task("putting back one group at a time", total=len(groups(student)) + 1)
        base, rows = put_back(student, teacher, reference, lambda: bar.advance(task))
    return {"packed": str(packed), "teacher": str(teacher_dir), "teacher_perplexity":
            reference.score(text.hf_logits_fn(teacher))["perplexity"], "base": base, "groups": rows}


def put_back(student: nn.Module, teacher: nn.Module, reference, tick=lambda: None) -> tuple[dict, list[dict]]:
    """``(the student's scores, one row per group)``: each group of :func:`groups` replaced by the teacher's
    modules, scored by ``reference`` (:class:`~pipeline.eval.text.TextReference`), and put back as it was."""
    from pipeline.eval import text

    if student.config.tie_word_embeddings:
        raise ValueError("sensitivity: a tied head and embedding cannot be put back one at a time; this measures "
                         "untied models (the SmolLM2 preset's rotation unties them)")
    score = lambda: reference.score(text.hf_logits_fn(student))    # noqa: E731
    base, rows = score(), []
    tick()
    for group, names in groups(student).items():
        old = {n: student.get_submodule(n) for n in names}
        for n in names:
            replace(student, n, copy.deepcopy(teacher.get_submodule(n)))
        s = score()
        for n, m in old.items():
            replace(student, n, m)
        rows.append({"group": group, "modules": len(names),
                     "params": sum(teacher.get_submodule(n).weight.numel() for n in names), "kl": s["kl"],
                     "perplexity": s["perplexity"], "kl_recovered": base["kl"] - s["kl"],
                     "perplexity_recovered": base["perplexity"] - s["perplexity"]})
        tick()
    return base, rows


def report_md(res: dict, command: str) -> str:
    base = res["base"]
    lines = [f"# Where the loss is: {res['packed']}", "",
             f"`{command}`", "",
             f"Student: KL {base['kl']:.4f} over {base['kl_tokens']} held-out answer tokens, perplexity "
             f"{base['perplexity']:.2f} over {base['perplexity_tokens']} held-out corpus tokens (teacher "
             f"{res['teacher_perplexity']:.2f}). Each row: that group put back to the teacher's weights alone.", "",
             "| group | matrices | weights (M) | KL | KL recovered | share of the KL | perplexity | perplexity "
             "recovered |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(res["groups"], key=lambda r: -r["kl_recovered"]):
        lines.append(f"| {r['group']} | {r['modules']} | {r['params'] / 1e6:.1f} | {r['kl']:.4f} | "
                     f"{r['kl_recovered']:.4f} | {r['kl_recovered'] / base['kl']:.0%} | {r['perplexity']:.2f} | "
                     f"{r['perplexity_recovered']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from pipeline.bench.real_model import params_defaults

    d = params_defaults()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packed", required=True, help="a packed text Llama (directory or model.safetensors)")
    ap.add_argument("--teacher", default=d.get("teacher") or "models/teacher", help="its source's HF directory")
    ap.add_argument("--teacher-data", default="data/teacher", help="teacher-answer shards (the last --heldout)")
    ap.add_argument("--heldout", type=int, default=d.get("heldout") or 64)
    ap.add_argument("--max-seq-len", type=int, default=d.get("max_seq_len") or 160)
    ap.add_argument("--ppl-tokens", type=int, default=2048, help="held-out corpus tokens for perplexity")
    ap.add_argument("--ppl-window", type=int, default=d.get("ppl_window") or 512)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    ap.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = measure(Path(args.packed), Path(args.teacher), args.teacher_data, args.heldout, args.max_seq_len,
                  args.ppl_tokens, args.ppl_window)
    command = "python -m pipeline.bench.sensitivity " + " ".join(sys.argv[1:] if argv is None else argv)
    write_json(f"{args.out}.json", res)
    write_text(f"{args.out}.md", report_md(res, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
