"""An "11B-shaped" skeleton of Llama 3.2 11B Vision, run through every pipeline step, with a memory model: the
command line, each step's peaks against the memory model's predictions, and the report
(``reports/skeleton_11b.{json,md}``). The skeleton, its steps and the memory model: :mod:`pipeline.bench.skeleton_11b_steps`.

    .venv/bin/python -m pipeline.bench.skeleton_11b all            # every step; reports/skeleton_11b.{json,md}
    .venv/bin/python -m pipeline.bench.skeleton_11b step fit       # one step (what ``all`` runs in a subprocess)
    .venv/bin/python -m pipeline.bench.skeleton_11b model          # the memory model of the full 11B, printed
    .venv/bin/python -m pipeline.bench.skeleton_11b report         # the reports again from reports/skeleton_11b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

import torch

from pipeline.bench import machine, skeleton_11b_steps
from pipeline.bench.skeleton_11b_steps import (GB, PRESETS, REPORT_JSON, REPORT_MD, ROOT, Size, Workload, count_params,
                                         dirs, full_11b_config, measure, measure_qat, qat_memory, skeleton_config,
                                         step_memory, table_11b)

def derive_states(source: str, target: str) -> dict:
    """The S3D8 states of preset ``target`` taken from those fitted on ``source`` (same checkpoint names: the
    reduced skeleton's layers are a subset of the full one's; an S3D8 state is a [32, 3] table, whatever the
    matrix's shape), so the reduction needs no second fit."""
    from pipeline import formats
    from pipeline.models import meta_model, quantised_weight_names

    fmt = formats.get(formats.SUBJECT)
    states = fmt.load_states(dirs(source)["states"])
    names = quantised_weight_names(meta_model(skeleton_config(PRESETS[target])))
    cross = PRESETS[source].cross_attention_layers[0]
    out = {}
    for saved in names.values():
        key = saved.removesuffix(".weight")
        if key not in states:      # a text layer of another kind at this index: the source's cross layer
            key = re.sub(r"(language_model\.(?:model\.)?layers\.)\d+\.", rf"\g<1>{cross}.", key)
        out[saved.removesuffix(".weight")] = states[key]
    fmt.save_states(dirs(target)["states"], out)
    return {"matrices": len(out), "from": source}


# ----------------------------------------------------------------------------------------------------------------
# Predicted vs measured, and the report
# ----------------------------------------------------------------------------------------------------------------


def base_rss_gb() -> float:
    """RSS of a fresh process after importing torch, transformers and the pipeline (measured here)."""
    code = ("import re,pathlib,torch,transformers,pipeline,pipeline.packed.file,pipeline.cast.fit,pipeline.qat.train;"
            "print(int(re.search(r'VmHWM:\\s+(\\d+)',pathlib.Path('/proc/self/status').read_text()).group(1)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return int(out.stdout.strip()) * 1024 / GB


def check_qat(rec: dict, counts: dict, base: float) -> dict:
    """The memory model's prediction for the measured skeleton QAT run (per rank, CPU: fp32 compute) vs the
    measured per-phase peaks, also as bytes per parameter above the base RSS."""
    cfg = skeleton_config(PRESETS[rec["preset"]])
    P = counts["total"]
    world = rec["processes"]
    w = Workload(micro_batch=1, seq=rec["seq"], tiles=cfg.vision_config.max_num_tiles)
    model = qat_memory(cfg, devices=world, workload=w, compute_bytes=4, teacher=rec["teacher"],
                       checkpointing=rec["gradient_checkpointing"], counts=counts)
    rank0 = rec["ranks"][0]["phases"]
    teacher_full = 2 * P
    # outside a step the sharded teacher holds its shard only (no units gathered)
    teacher_rest = teacher_full / world if rec["teacher"] == "shard" else teacher_full
    predicted = {
        # rank 0 reads the whole teacher and, on the CPU, keeps its own shard beside it in host memory
        "load_teacher": base * GB + teacher_full + (teacher_rest if rec["teacher"] == "shard" else 0),
        # rank 0: the whole fp32 student it loads (the other ranks never hold it) and its own shards filled from it
        "load_student": base * GB + teacher_rest + 4 * P + 4 * P / world,
        "train": base * GB + model["total"],
        # rank 0 gathers the whole student, and save_pretrained's safetensors serialiser copies it to bytes
        "save_student": base * GB + teacher_rest + 16 * P / world + 4 * P + 4 * P,
    }
    rows = []
    for phase, pred in predicted.items():
        meas = rank0.get(phase, {}).get("peak_rss_gb")
        if meas is None:
            continue
        rows.append({"phase": phase, "measured_gb": meas, "predicted_gb": round(pred / GB, 3),
                     "measured_bytes_per_param": round((meas - base) * GB / P, 2),
                     "predicted_bytes_per_param": round(pred / P - base * GB / P, 2),
                     "ratio": round(meas / (pred / GB), 3)})
    return {"params": P, "base_gb": round(base, 3), "model_parts_gb": {k: round(v / GB, 3) for k, v in model["parts"].items()},
            "rows": rows}


def check_steps(steps: dict, counts: dict, base: float) -> list[dict]:
    file_bytes = None
    pack = steps.get("pack", {}).get("result", {})
    if "file_bytes" in pack:
        file_bytes = pack["file_bytes"]
    pred = step_memory(counts, base * GB, file_bytes)
    rows = []
    for name, key in (("build", "build"), ("fit", "fit"), ("pack", "pack"), ("load_lazy", "load_lazy"),
                      ("load_eager", "load_eager")):
        rec = steps.get(name)
        if not rec or "peak_rss_gb" not in rec:
            continue
        rows.append({"step": name, "measured_gb": rec["peak_rss_gb"], "predicted_gb": round(pred[key] / GB, 3),
                     "ratio": round(rec["peak_rss_gb"] / (pred[key] / GB), 3)})
    return rows


def write_report(data: dict) -> None:
    REPORT_JSON.write_text(json.dumps(data, indent=1, default=str) + "\n")
    REPORT_MD.write_text(markdown(data))


def _gb(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(data: dict) -> str:
    L = ["# The 11B-shaped skeleton: every step at full width, and a memory model for the 11B", "",
         "Written by `python -m pipeline.bench.skeleton_11b all` (numbers: `reports/skeleton_11b.json`). "
         f"Machine: {data.get('machine', '')}.", ""]
    sk = data.get("skeleton", {})
    if sk:
        L += ["## The skeleton", "", f"- full: {sk['full']['description']}",
              f"- qat (the reduction QAT ran on): {sk['qat']['description']}", ""]
        L += ["| preset | parameters | quantised | largest matrix | checkpoint (bf16) |", "|---|---:|---:|---:|---:|"]
        for k in ("full", "qat"):
            c = sk[k]["counts"]
            L.append(f"| {k} | {c['total'] / 1e9:.3f} B | {c['quantised'] / 1e9:.3f} B | {c['largest_matrix'] / 1e6:.1f} M | "
                     f"{_gb(sk[k].get('checkpoint_gb'))} GB |")
        L.append("")
    chk = data.get("check", {})
    L += _steps_markdown(data) + _checks_markdown(chk) + _model_markdown(data.get("model_11b"), chk)
    for note in data.get("notes", []):
        L.append(f"- {note}")
    return "\n".join(L) + "\n"


def _steps_markdown(data: dict) -> list[str]:
    L: list[str] = []
    steps = data.get("steps", {})
    if steps:
        L += ["## Measured steps (peak RSS of a fresh process per step)", "",
              f"Base RSS (python + torch + transformers + pipeline imported): {_gb(data.get('base_rss_gb'))} GB.", "",
              "| step | preset | wall s | peak RSS GB | phases (peak GB / s) | result |", "|---|---|---:|---:|---|---|"]
        for name, rec in steps.items():
            if "error" in rec:
                L.append(f"| {name} | {rec.get('preset')} | {rec.get('seconds')} | - | failed | "
                         f"`{rec['error'].strip().splitlines()[-1][:120] if rec['error'].strip() else rec.get('returncode')}` |")
                continue
            if name.startswith("qat"):
                ph = rec["ranks"][0]["phases"]
                phase_s = "; ".join(f"{k} {v['peak_rss_gb']:.2f}/{v['seconds']:.0f}" for k, v in ph.items())
                kl = [r.get("summary", {}) for r in rec["ranks"] if r.get("summary")]
                res = f"{rec['steps']} steps, {rec['ranks'][0]['seconds_per_step']} s/step"
                if kl:
                    res += f", KL first {kl[0].get('kl_first', float('nan')):.3f}"
                L.append(f"| {name} | {rec['preset']} | {rec['seconds']} | {' + '.join(_gb(x) for x in rec['peak_rss_gb_per_rank'])} "
                         f"(ranks) | rank 0: {phase_s} | {res} |")
                continue
            phase_s = "; ".join(f"{k} {v['peak_rss_gb']:.2f}/{v['seconds']:.0f}" for k, v in rec["phases"].items())
            r = rec.get("result", {})
            res = ""
            if name == "fit":
                res = f"{r.get('matrices')} matrices, rel. RMSE {r.get('rel_rmse', 0):.4f}, {r.get('bits_per_param', 0):.3f} bit"
            elif name == "pack":
                res = f"{r.get('file_bytes', 0) / GB:.3f} GB, {r.get('bits_per_param_actual', 0):.3f} bit actual"
            elif name.startswith("generate"):
                res = (f"{r.get('prompt_tokens')} prompt + {r.get('image_tokens')} image tokens; logits finite "
                       f"{r.get('logits_finite')}; {len(r.get('generated', []))} tokens at {r.get('generate_tokens_per_s')} tok/s")
            elif name.startswith("build"):
                res = f"{r.get('params', 0) / 1e9:.3f} B params, {r.get('bytes', 0) / GB:.2f} GB"
            L.append(f"| {name} | {rec['preset']} | {rec['seconds']} | {_gb(rec['peak_rss_gb'])} | {phase_s} | {res} |")
        L.append("")
    return L


def _checks_markdown(chk: dict) -> list[str]:
    L: list[str] = []
    if chk.get("steps"):
        L += ["## The memory model against the skeleton", "", "Single-process steps (`step_memory`):", "",
              "| step | measured GB | predicted GB | measured / predicted |", "|---|---:|---:|---:|"]
        for r in chk["steps"]:
            L.append(f"| {r['step']} | {r['measured_gb']:.2f} | {r['predicted_gb']:.2f} | {r['ratio']:.2f} |")
        L.append("")
    for key, rec in (chk.get("qat") or {}).items():
        L += [f"QAT `{key}`, rank 0, per phase (`qat_memory` with fp32 compute, 2 ranks; bytes per parameter above "
              f"the base RSS, P = {rec['params'] / 1e6:.0f} M):", "",
              "| phase | measured GB | predicted GB | measured B/param | predicted B/param | ratio |",
              "|---|---:|---:|---:|---:|---:|"]
        for r in rec["rows"]:
            L.append(f"| {r['phase']} | {r['measured_gb']:.2f} | {r['predicted_gb']:.2f} | {r['measured_bytes_per_param']:.2f} | "
                     f"{r['predicted_bytes_per_param']:.2f} | {r['ratio']:.2f} |")
        L.append("")
        L.append("Predicted train-phase parts (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in rec["model_parts_gb"].items()))
        L.append("")
    return L


def _model_markdown(m: dict | None, chk: dict) -> list[str]:
    L: list[str] = []
    if m:
        c = m["counts"]
        L += ["## The memory model: Llama 3.2 11B Vision on 8 x 80 GB GPUs, FSDP2, bf16 compute", "",
              f"Parameters (MllamaConfig defaults on `meta`, 560-pixel tiles): {c['total'] / 1e9:.3f} B, of which "
              f"{c['quantised'] / 1e9:.3f} B quantised in {c['quantised_matrices']} matrices; largest FSDP unit "
              f"{c['largest_unit'] / 1e6:.0f} M (the token embedding; a text decoder layer is {c['text_self_layer'] / 1e6:.0f} M), embedding {c['embed'] / 1e6:.0f} M, "
              f"lm_head {c['lm_head'] / 1e6:.0f} M. Workload: batch 128 = 8 GPUs x micro-batch "
              f"{m['rows'][0]['workload']['micro_batch']} x grad_accum 4, {m['rows'][0]['workload']['seq']} text tokens "
              f"+ {m['rows'][0]['workload']['tiles']} tiles x 1601 = 6404 image tokens a sequence.", "",
              "| GB per GPU | " + " | ".join(f"teacher {r['teacher']}, {'ckpt' if r['checkpointing'] else 'no ckpt'}"
                                          for r in m["rows"]) + " |",
              "|---|" + "---:|" * len(m["rows"])]
        for part in m["rows"][0]["parts"]:
            L.append(f"| {part} | " + " | ".join(f"{r['parts'][part] / GB:.1f}" for r in m["rows"]) + " |")
        L.append("| **total** | " + " | ".join(f"**{r['total'] / GB:.1f}**" for r in m["rows"]) + " |")
        L.append("| fits 80 GB | " + " | ".join("yes" if r["total"] < 76 * GB else "no" for r in m["rows"]) + " |")
        L.append("| host RAM of rank 0 at load (fp32 student + whole teacher; other ranks hold neither when sharded) | " + " | ".join(f"{r['host_load'] / GB:.0f}" for r in m["rows"]) + " |")
        L.append("")
        s = m.get("single_steps")
        if s:
            ratios = {r["step"]: r["ratio"] for r in chk.get("steps", [])}
            L += ["Single-process steps at 11B (host RAM, `step_memory`; calibrated = predicted x the skeleton's "
                  "measured / predicted ratio; fit and pack stream one matrix at a time and the skeleton's largest "
                  "matrix is the 11B's, the token embedding, so their peaks do not grow with depth):", "",
                  "| step | predicted GB | calibrated GB |", "|---|---:|---:|"]
            for k, v in s.items():
                cal = f"{v / GB * ratios[k]:.1f}" if k in ratios else "-"
                L.append(f"| {k} | {v / GB:.1f} | {cal} |")
            L.append("")
            host = m["rows"][0]["host_load"]
            teacher_gb = 2 * m["rows"][0]["params"] / GB
            L += [f"Host RAM at QAT start: rank 0 reads the fp32 student and, with `launch.teacher: shard`, the bf16 "
                  f"teacher, and fills the other ranks' shards from them ({host / GB:.0f} GB on rank 0, none of it on "
                  f"the others, whose modules are built on `meta`); with `launch.teacher: replicate` every rank also "
                  f"loads the whole teacher ({teacher_gb:.0f} GB each, {8 * teacher_gb:.0f} GB for a node's 8 ranks).", ""]
    return L



def describe(s: Size) -> str:
    return (f"vocab {s.vocab_size} (+ image token), text {s.text_layers} layers (cross-attention at "
            f"{s.cross_attention_layers}) of width {s.text_hidden} / MLP {s.text_intermediate}, "
            f"{s.text_heads} / {s.text_kv_heads} heads; vision {s.vision_layers} + {s.vision_global_layers} layers "
            f"of width {s.vision_hidden} / MLP {s.vision_intermediate}, {s.image_size} px, patch {s.patch_size}, "
            f"{s.max_num_tiles} tile(s) = {s.max_num_tiles * ((s.image_size // s.patch_size) ** 2 + 1)} image tokens")


def model_11b(base_gb: float = 0.3) -> dict:
    config = full_11b_config()
    counts = count_params(config)
    rows = table_11b()
    base = base_gb * GB
    return {"counts": counts, "rows": rows, "single_steps": step_memory(counts, base)}


STEPS = ["build", "fit", "pack", "load_lazy", "load_eager", "generate_lazy", "generate_eager"]


def run_all(only: list[str] | None = None, gen_tokens: int = 3) -> dict:
    data = json.loads(REPORT_JSON.read_text()) if REPORT_JSON.exists() else {}
    data.setdefault("steps", {})
    import platform
    data["machine"] = (f"{machine.line(machine.describe())}, "
                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GB:.0f} GB RAM, "
                       f"{platform.machine()}, torch {torch.__version__}, no GPU")
    data["base_rss_gb"] = round(base_rss_gb(), 3)
    plan = only or STEPS + ["build_qat", "states_qat", "qat"]
    for name in plan:
        print(f"[skeleton] {name} ...", flush=True)
        if name == "build_qat":
            rec = measure("build", "qat")
        elif name == "states_qat":
            data["states_qat"] = derive_states("full", "qat")
            continue
        elif name == "qat":
            rec = measure_qat("qat", teacher="shard", ckpt=True)
            data["steps"]["qat_shard_ckpt"] = rec
            print(json.dumps({k: v for k, v in rec.items() if k != "ranks"}, default=str)[:2000], flush=True)
            write_report(finish(data))
            continue
        elif name.startswith("qat_"):          # qat_<teacher>_<ckpt|nockpt>
            _, teacher, ck = name.split("_")
            rec = measure_qat("qat", teacher=teacher, ckpt=ck == "ckpt")
        elif name.startswith("generate"):
            rec = measure(name, "full", str(gen_tokens))
        else:
            rec = measure(name, "full")
        data["steps"][name] = rec
        print(json.dumps({k: v for k, v in rec.items() if k != "ranks"}, default=str)[:1500], flush=True)
        write_report(finish(data))
    return finish(data)


NOTES = [
    "Image tokens: Mllama's vision encoder runs 4 tiles x 1,608 patches (1,601 padded to a multiple of 8) = 6,432 "
    "positions, and the language model cross-attends to 4 x 1,601 = 6,404 image tokens a picture; 7,680 is the "
    "width of the vision output (1280 x (1 final + 5 intermediate layers)), the projector's input, not a token count.",
    "Processor: the toy builder cannot be reused (its vocabulary is a BPE trainer's target, never reached by a small "
    "corpus, and its specials sit at ids 0-10), so `build_processor` trains a ~1k-token byte-level BPE with the Llama 3 "
    "pre-tokenizer, pads the vocabulary with unreachable filler tokens, puts the 256 Llama 3 specials at "
    "128000-128255 and `<|image|>` at 128256; Mllama's image processor at 560 px x 4 tiles; the toy's chat template.",
    "Weights: built on `meta`, materialised empty in bf16 and filled in place tensor by tensor (seeded per name: "
    "N(0, 0.02), norms 1, tanh gates 1, the padding row 0), then `save_pretrained` in 2 GB shards: one bf16 copy.",
    "Pack: a direct cast with the format's own absmax encoder (`fmt.pack`) through `write_model_dir` (HF directory, "
    "config in the metadata): the encoder's peak, not the pack-safetensors stage's (which now copies stage "
    "direct-cast's packed files). Its peak, at the token embedding: the embedding's bf16 pages mapped by safetensors "
    "(RssFile, 2 B a weight), its fp32 copy and its packed bytes. `CheckpointReader.get` opens a handle per tensor, "
    "so a tensor's pages leave the process with it (a cached handle once kept every page read: 2 GB at the peak, "
    "the whole checkpoint by the end), and the encoder's finiteness check reads min and max instead of a full-size "
    "mask (that mask's temporaries were 3.4 GB at the embedding).",
    "QAT ran on the reduction `qat` (2 CPU processes, gloo, FSDP2, fp32 compute, teacher sharded, gradient "
    "checkpointing, 3 steps of 2 sequences of 128 tokens): every 11B matrix shape except the vocabulary's "
    "(16,384 rows instead of 128,256), 1 text layer (cross-attention), 1 + 1 vision layers, 1 tile. The full "
    "skeleton does not fit two ranks in 24 GB: the measured train phase is ~23 B/param a rank (the fake-quantised "
    "units gathered in fp32 and the fp32 gradients reduce-scattered each micro-batch). Its S3D8 tables are the full "
    "skeleton's (same checkpoint names; an S3D8 state is a 32 x 3 table whatever the matrix's shape).",
    "Lazy vs eager: both generate the same tokens from the same logits path; lazy keeps the model at ~1 GB "
    "(the 0.63 GB file) and its forward peaks near 3 GB (each packed weight decoded in row blocks, lm_head "
    "included); eager holds its ~8 GB of decoded weights and peaks at load, where every weight is decoded.",
    "The memory model's activation terms are estimates (element counts per token and layer, SDPA without stored "
    "attention probabilities); the parameter terms are exact byte counts. With checkpointing the unit being "
    "recomputed holds its fake-quantised weights for its backward (counted); the train ratio left above 1 is the "
    "fake-quant's transient temporaries and allocator slack. At save, safetensors' serialiser copies rank 0's "
    "gathered fp32 student to bytes (counted: 8 B a parameter on rank 0's host).",
]


def finish(data: dict) -> dict:
    data["notes"] = NOTES
    data["skeleton"] = {}
    for k in ("full", "qat"):
        counts = count_params(skeleton_config(PRESETS[k]))
        ck = sum(f.stat().st_size for f in dirs(k)["model"].glob("*.safetensors")) / GB if dirs(k)["model"].exists() else None
        data["skeleton"][k] = {"size": dataclasses.asdict(PRESETS[k]), "description": describe(PRESETS[k]),
                               "counts": counts, "checkpoint_gb": ck}
    base = data.get("base_rss_gb", 0.6)
    data["check"] = {"steps": check_steps(data["steps"], data["skeleton"]["full"]["counts"], base), "qat": {}}
    for key, rec in data["steps"].items():
        if key.startswith("qat") and "ranks" in rec and "error" not in rec:
            data["check"]["qat"][key] = check_qat(rec, data["skeleton"]["qat"]["counts"], base)
    data["model_11b"] = model_11b(base)
    return data


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["step"], ["qat-rank"]):
        skeleton_11b_steps.main(argv)
        return
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.skeleton_11b",
                                     description="the 11B-shaped skeleton: every step, the report, the memory model")
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all", help="run every step (or --only some) and write the reports")
    a.add_argument("--only", nargs="*", help=f"steps among {STEPS + ['build_qat', 'states_qat', 'qat', 'qat_replicate_ckpt', 'qat_shard_nockpt']}")
    a.add_argument("--tokens", type=int, default=3)
    sub.add_parser("model", help="print the 11B memory model")
    sub.add_parser("report", help="rewrite the reports from reports/skeleton_11b.json")
    args = parser.parse_args(argv)
    if args.cmd == "all":
        write_report(run_all(args.only, args.tokens))
    elif args.cmd == "model":
        m = model_11b()
        for r in m["rows"]:
            print(f"teacher {r['teacher']:9s} ckpt {r['checkpointing']!s:5s} total {r['total'] / GB:7.1f} GB  " +
                  "  ".join(f"{k} {v / GB:.1f}" for k, v in r["parts"].items()))
    elif args.cmd == "report":
        write_report(finish(json.loads(REPORT_JSON.read_text())))


if __name__ == "__main__":
    main()
