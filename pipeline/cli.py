"""The ``s3d8`` command: the library's main operations without the DVC pipeline.

    s3d8 pack MODEL_DIR OUT [--format s3d8] [--calibration TEXT]  # calibrated cast to a packed file (SPEC section 7)
    s3d8 eval PACKED [--tasks toy-vqa ...] [--n 16]               # score a packed model on the (toy) tasks
    s3d8 export-sqt PACKED OUT.sqt [--tokenizer DIR]              # the reference engine's .sqt v3 file
    s3d8 bench [--shape 1,4096,4096] [--threads 1]                # S3D8 vs INT8 and BF16 on the native kernels
    s3d8 generate PACKED --prompt TEXT [--image PATH] ...         # pipeline.runtime.generation's generation

``OUT`` of ``pack``: a ``.safetensors`` file, or a directory: the Hugging Face directory pack-safetensors writes
(config.json with its quantization_config, processor, generation config, model card). ``PACKED``: a packed file or such a directory. ``--threads`` means the
same in every command: 0 keeps torch's default, 1 .. the CPUs this process may use sets it, anything else is an
error.

Exit status (every command): 0 done; 1 an error, printed as one line on stderr (a bad model file, a value out of
range, a failed run); 2 a command line argparse cannot parse (unknown option, missing argument, a value that is
not a number), printed with the usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

THREADS_HELP = "threads (default 0: torch's default; at most the CPUs this process may use)"


def _packed_file(path: str) -> Path:
    p = Path(path)
    return p / "model.safetensors" if p.is_dir() else p


def _model_dir(path: str, tokenizer: str | None) -> str:
    """The directory with the tokenizer / processor for a packed model (``--tokenizer``, the model directory,
    or the packed file's source model)."""
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.sqt.blocks import tokenizer_dir

    file = _packed_file(path)
    directory = Path(path) if Path(path).is_dir() else None
    return str(tokenizer_dir(file, CheckpointReader(file).metadata(), directory, tokenizer))


def cmd_pack(args) -> int:
    pack_model(args)
    return 0


def pack_model(args) -> dict:
    """``s3d8 pack``'s work: the packed model written, its one-line summary and held-out comparison printed;
    returns ``{"summary", "held_out", "seconds", "plan"}`` (``pipeline/bench/ptq_ablation.py`` records it)."""
    import tempfile

    import torch

    from pipeline import formats
    from pipeline.cast import direct as direct_cast
    from pipeline.chat import tokenizer_of
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.files.atomic import atomic_dir
    from pipeline.models import dtype_of, load_model, load_processor, quantised_weight_names
    from pipeline.packed.file import write_packed
    from pipeline.formats.precision import Precision, parse_rules
    from pipeline.cast.rotate import auto_rotation, rotate_llama
    from pipeline.stage import progress
    from pipeline.teacher.source import local_dir

    fmt = formats.comparison(args.format, "--format")
    plan = Precision(fmt, parse_rules(args.precision))
    for flag, value in (("--calibration-windows", args.calibration_windows), ("--window", args.window),
                        ("--eval-tokens", args.eval_tokens or 2)):
        if value < 2:
            raise ValueError(f"{flag} {value}: must be at least 2")
    source = local_dir(args.model)
    out = Path(args.out)
    as_dir = out.suffix != ".safetensors"
    if as_dir:
        _check_pack_dir(out, source)
    tokenizer = tokenizer_of(load_processor(str(source)))
    windows, what = _calibration_windows(args.calibration, tokenizer, args.calibration_windows, args.window)
    inputs = [{"input_ids": torch.tensor([w])} for w in windows]
    model = load_model(str(source), torch.float32)
    if args.rotate == "auto":
        args.rotate = auto_rotation(model.config)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, progress() as bar:
        if args.rotate != "none":         # the rotated model, saved in float32, is what is packed
            rotate_llama(model, args.rotate, args.seed)
            model.save_pretrained(f"{tmp}/rotated")
            load_processor(str(source)).save_pretrained(f"{tmp}/rotated")
            source = Path(f"{tmp}/rotated")
        names = [n for n in dict.fromkeys(s.removesuffix(".weight") for s in quantised_weight_names(model).values())
                 if plan.format_of(n) is not None]
        task = bar.add_task(f"pack {plan.describe()} ({args.algorithm}, {len(inputs)} windows of {what})",
                            total=len(names))
        staging = Path(tmp) / "cast"
        staging.mkdir()
        direct_cast.cast_in_order(plan, model, inputs, lambda name: None, args.algorithm, staging, "s3d8 pack",
                                  on_matrix=lambda: bar.advance(task), act_order=args.act_order)
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(direct_cast.group_of(name), []).append(name)
        direct_cast.write_index(staging, plan, args.algorithm, groups, {})
        cast = direct_cast.DirectCast(staging, fmt)
        del model
        states = {n: {} for n in names}
        other = {n: f for n in names if (f := plan.format_of(n)) is not fmt}
        encode = lambda name, weight, state: cast.packed(name, weight.shape)  # noqa: E731
        metadata = {"method": "direct-cast", "source_model": args.model, "config": json.loads(
            (source / "config.json").read_text()), "pack_command": {
                "algorithm": args.algorithm, "act_order": args.act_order, "precision": plan.rules, "rotate": args.rotate, "seed": args.seed,
                "calibration": what, "windows": len(inputs), "window": args.window},
            **({"rotate": args.rotate, "rotate_seed": args.seed} if args.rotate != "none" else {})}
        if as_dir:      # the Hugging Face directory pack-safetensors writes (config, processor, card), atomically
            from pipeline.hf.write import write_model_dir

            name = args.model.rstrip("/").rpartition("/")[2]
            with atomic_dir(out) as tmp_out:
                summary = write_model_dir(tmp_out, CheckpointReader(source), fmt, states, teacher_dir=source,
                                          method="direct-cast", base_model=args.model, teacher_name=name,
                                          dtype=dtype_of(args.dtype), metadata={**metadata, "teacher": name},
                                          encode=encode, other=other)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            summary = write_packed(out, CheckpointReader(source), fmt, states, dtype=dtype_of(args.dtype),
                                   metadata=metadata, encode=encode, other=other)
    seconds = time.perf_counter() - began
    print(f"{out}: {summary['file_bytes']} bytes, {summary['bits_per_param_actual']:.3f} bits/param over the "
          f"quantised weights ({plan.describe()}; bits per weight: whole model {summary['bits_per_weight_whole']:.2f}, "
          f"decoder Linears {summary['bits_per_weight_linears']:.2f}), cast in {seconds:.0f} s")
    held_out = _held_out_line(local_dir(args.model), out, tokenizer, args.eval_tokens, args.window) \
        if args.eval_tokens else None
    return {"summary": summary, "held_out": held_out, "seconds": seconds, "plan": plan.describe()}


def _calibration_windows(path: str | None, tokenizer, n: int, window: int) -> tuple[list[list[int]], str]:
    """``(windows, what)`` of ``s3d8 pack --calibration``: the user's file, or by default half the windows from the
    Python documentation's prose (its calibration half) and half from the shipped English (fiction, talks, an
    encyclopedia article: :mod:`pipeline.texts`), alternating. Either alone fits the cast to its own kind of text
    (README, "A cast that respects the data")."""
    from pipeline import texts
    from pipeline.texts import CORPUS, corpus_text, read_file, text_windows

    if path is None:
        docs = text_windows(corpus_text("rest"), tokenizer, n - n // 2, window, CORPUS)
        english = text_windows(texts.read("english"), tokenizer, n // 2, window, "english")
        mixed = [w for pair in zip(docs, english) for w in pair] + docs[len(english):] + english[len(docs):]
        return mixed, f"{CORPUS} (not its held-out half) + the shipped English text"
    text = read_file(path, "--calibration")
    return text_windows(text, tokenizer, n, window, path), path


def _held_out_line(source: Path, out: Path, tokenizer, tokens: int, window: int) -> dict:
    """The packed model against its source on held-out text, one line: KL and perplexity on the Python
    documentation's held-out half, perplexity on the shipped independent English (``english-heldout``: nothing
    calibrates on it); a warning if either is above twice the source's."""
    import torch

    from pipeline import texts
    from pipeline.eval.text import compare_on_windows, hf_logits_fn
    from pipeline.texts import CORPUS, corpus_windows, text_windows
    from pipeline.models import load_model
    from pipeline.packed.file import load_packed_model

    teacher = hf_logits_fn(load_model(str(source), torch.float32))
    packed = hf_logits_fn(load_packed_model(_packed_file(str(out))))
    r = compare_on_windows(teacher, packed, corpus_windows(tokenizer, tokens, window))
    other = compare_on_windows(teacher, packed, text_windows(texts.read("english-heldout"), tokenizer,
                                                             -(-tokens // window), window, "english-heldout"))
    ratio, ratio_other = (x["perplexity"] / x["teacher_perplexity"] for x in (r, other))
    print(f"held-out {CORPUS}, {r['tokens']} tokens: KL {r['kl']:.4f}, perplexity {r['perplexity']:.2f} "
          f"(source {r['teacher_perplexity']:.2f}, {ratio:.2f}x); independent English (english-heldout), "
          f"{other['tokens']} tokens: KL {other['kl']:.4f}, perplexity {other['perplexity']:.2f} "
          f"(source {other['teacher_perplexity']:.2f}, {ratio_other:.2f}x)")
    if max(ratio, ratio_other) > 2:
        print(f"warning: the packed model's perplexity is {max(ratio, ratio_other):.1f}x the source's: this cast "
              f"broke it (try --precision with more INT8, a --calibration text like yours, or QAT)", file=sys.stderr)
    return {**r, "independent": {"text": "english-heldout", **other}}


def _check_pack_dir(out: Path, source: Path) -> None:
    """``s3d8 pack`` replaces OUT_DIR whole: only an empty directory or an earlier packed one, never the source."""
    if out.resolve() == source.resolve() or out.resolve() in source.resolve().parents:
        raise ValueError(f"{out}: the output directory would replace the model it packs ({source})")
    if out.is_file():
        raise ValueError(f"{out}: is a file; give a directory or a .safetensors file")
    if out.is_dir() and any(out.iterdir()):
        config = out / "config.json"
        try:
            packed = json.loads(config.read_text()).get("model_type", "").startswith("s3d8-pipeline-")
        except (OSError, ValueError, AttributeError):
            packed = False
        if not packed:
            raise ValueError(f"{out}: exists and is not a packed model directory; give a new or empty directory "
                             f"(pack replaces it whole)")


def cmd_eval(args) -> int:
    import torch

    import pipeline.toy.tasks  # noqa: F401  (registers the toy tasks)
    from pipeline.eval.runner import evaluate
    from pipeline.models import load_processor
    from pipeline.packed.file import load_packed_model
    from pipeline.runtime.generation import check_threads

    for flag, value in (("--n", args.n), ("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    check_threads(args.threads)
    torch.manual_seed(args.seed)
    model = load_packed_model(_packed_file(args.model), kernel=args.kernel)
    processor = load_processor(_model_dir(args.model, args.tokenizer))
    result = evaluate(model, processor, args.tasks, n=args.n, seed=args.seed, batch_size=args.batch_size,
                      max_new_tokens={t: args.max_new_tokens for t in args.tasks} if args.max_new_tokens else None)
    summary = result.summary()
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    for task, score in sorted(result.scores.items()):
        print(f"{task:16s} {score:.4f}")
    print(f"{'average':16s} {result.avg:.4f}")
    return 0


def cmd_export_sqt(args) -> int:
    from pipeline.sqt import write as sqt

    return sqt.main(["export", args.model, args.out, *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
                     "--alignment", str(args.alignment)])


def cmd_bench(args) -> int:
    import torch

    from pipeline import formats, native
    from pipeline.runtime.generation import check_threads

    threads = check_threads(args.threads)
    if not args.seconds >= 0:
        raise ValueError(f"--seconds {args.seconds}: must be >= 0")
    try:
        m, k, n = (int(v) for v in args.shape.split(","))
    except ValueError:
        raise ValueError(f"--shape {args.shape!r}: expected m,k,n (e.g. 1,4096,4096)") from None
    if min(m, k, n) < 1:
        raise ValueError(f"--shape {args.shape!r}: every dimension must be >= 1")
    fmts = [formats.get(name) for name in args.formats.split(",")]
    if not all(f.native_kernel for f in fmts):
        raise ValueError(f"--formats {args.formats}: the native kernels run "
                         f"{', '.join(f for f in formats.names() if formats.get(f).native_kernel)}")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    linears = {f.name: f.native_linear(f.pack(weight, f.fit(weight, seed=0)), (n, k), None) for f in fmts}
    print(f"native variant {native.variant()} (available: {', '.join(native.available_variants())}), "
          f"m={m} k={k} n={n}, threads={threads}")
    with torch.no_grad():
        for name, linear in linears.items():
            linear(x)                                # warm-up
            times = []
            deadline = time.perf_counter() + args.seconds
            while len(times) < 3 or time.perf_counter() < deadline:
                t0 = time.perf_counter()
                linear(x)
                times.append(time.perf_counter() - t0)
            best = min(times)
            print(f"{name:5s} {best * 1e6:10.1f} us  {m * k * n / best / 1e9:8.2f} GMAC/s  ({len(times)} runs)")
    return 0


def cmd_generate(args, rest: list[str]) -> int:
    """``python -m pipeline.runtime`` under the name ``s3d8 generate`` (its own options, help and errors)."""
    try:
        from pipeline.runtime import generation as runtime
    except ImportError as e:
        print(f"error: s3d8 generate needs pipeline.runtime.generation, which this installation lacks ({e}); "
              f"update the package", file=sys.stderr)
        return 1
    if not hasattr(runtime, "main"):
        print("error: pipeline.runtime.generation has no command-line entry point (main) in this version", file=sys.stderr)
        return 1
    return int(runtime.main(rest, prog="s3d8 generate") or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="s3d8", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:8]) + "\n\nexit status: 0 done, 1 an "
                                     "error (one line on stderr), 2 a command line that cannot be parsed")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("pack", help="fit and pack a model directory (direct cast)")
    p.add_argument("model", help="model directory (Hugging Face layout) or hub id")
    p.add_argument("out", help="OUT.safetensors (the packed file alone), or a directory: the Hugging Face "
                              "directory pack-safetensors writes (config.json with quantization_config, "
                              "processor, generation config, model card)")
    p.add_argument("--format", default="s3d8", help="s3d8, int, student_t or lloyd_max (default s3d8)")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the tensors that are not quantised")
    p.add_argument("--precision", default="embed_tokens$=int8",
                   help="the precision plan: PATTERN=FORMAT rules, comma-separated, the first matching the weight "
                        "name wins (formats: int8, s3d8, ..., bf16 keeps it); 'none' puts every matrix in --format "
                        "(default: embed_tokens$=int8, the token embedding and a tied output head in INT8)")
    p.add_argument("--algorithm", default="gptq", choices=["gptq", "search", "absmax"],
                   help="post-training algorithm; gptq takes each matrix's X^T X from the partly cast model (default)")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=False,
                   help="gptq: round each matrix's columns by decreasing X^T X diagonal (GPTQModel's desc_act; pays "
                        "with many calibration windows, e.g. 128 x 512 tokens; default: off)")
    p.add_argument("--calibration", help="UTF-8 text file to calibrate on (default: half the windows from the "
                                         "Python documentation's prose, pydoc_data's topics, the half perplexity is "
                                         "not measured on; half from the public-domain English the package ships)")
    p.add_argument("--calibration-windows", type=int, default=16, help="windows of calibration text (default 16)")
    p.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--rotate", default="auto", choices=["auto", "none", "orthogonal", "hadamard"],
                   help="rotate the residual stream of a text Llama or an Mllama's language model first (exact; "
                        "unties a tied output head: one more vocabulary-sized matrix); auto (default): hadamard "
                        "for those (orthogonal where no Hadamard matrix of the width is built), none for other models")
    p.add_argument("--seed", type=int, default=0, help="seed of the rotation (default 0)")
    p.add_argument("--eval-tokens", type=int, default=4096,
                   help="held-out tokens to compare the packed model with its source on at the end (0: skip; "
                        "default 4096)")
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("eval", help="score a packed model on evaluation tasks")
    p.add_argument("model", help="packed .safetensors file or its directory")
    p.add_argument("--tasks", nargs="+", default=["toy-vqa", "toy-chartqa", "toy-docvqa", "toy-ai2d"],
                   help="tasks to score (default: the four toy tasks)")
    p.add_argument("--n", type=int, default=16, help="examples per task, at least 1 (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the examples drawn (default 0)")
    p.add_argument("--batch-size", type=int, default=16, help="examples per forward, at least 1 (default 16)")
    p.add_argument("--max-new-tokens", type=int, help="override the per-task cap (at least 1)")
    p.add_argument("--kernel", default="torch", choices=["torch", "native"],
                   help="torch (decoded weights) or native (the packed bytes on the C kernels); default torch")
    p.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    p.add_argument("--tokenizer", help="processor directory (default: beside the model or its source model)")
    p.add_argument("--json", help="also write the scores to this JSON file")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export-sqt", help="write the reference engine's .sqt v3 file of a packed S3D8 model")
    p.add_argument("model", help="packed S3D8 .safetensors file or its directory")
    p.add_argument("out", help="output .sqt file")
    p.add_argument("--tokenizer", help="tokenizer directory (default: beside the model or its source model)")
    p.add_argument("--alignment", type=int, default=32, help="byte alignment of the tensor data (default 32)")
    p.set_defaults(func=cmd_export_sqt)

    p = sub.add_parser("bench", help="time S3D8, INT8 and BF16 matmuls on the native kernels")
    p.add_argument("--shape", default="1,4096,4096", help="m,k,n (default 1,4096,4096)")
    p.add_argument("--threads", type=int, default=1, help=THREADS_HELP.replace("default 0: ", "default 1; 0: "))
    p.add_argument("--seconds", type=float, default=1.0, help="time per format (default 1.0)")
    p.add_argument("--formats", default="s3d8,int8,bf16", help="formats the native kernels run (default s3d8,int8,bf16)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("generate", add_help=False,
                       help="generate with pipeline.runtime.generation (`s3d8 generate --help` for its options)")
    p.set_defaults(func=None)
    p = sub.add_parser("serve", add_help=False,
                       help="serve a packed model behind an OpenAI-compatible HTTP API (`s3d8 serve --help`)")
    p.set_defaults(func=None)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("s3d8-pipeline")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "generate":
        return cmd_generate(None, argv[1:])
    if argv and argv[0] == "serve":
        from pipeline import serve

        return serve.main(argv[1:])
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"s3d8 {args.command}: error: {message}", file=sys.stderr)
        return 1
    except ImportError as e:        # a module of an extra the installation lacks (pyproject.toml)
        extra = "eval" if args.command == "eval" else "pipeline"
        print(f"s3d8 {args.command}: error: needs {e.name or e}, of the [{extra}] extra this installation lacks: "
              f"pip install 's3d8-pipeline[{extra}]' (or the repository / wheel with [{extra}])", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
