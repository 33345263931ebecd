"""DVC stage pack-safetensors: pack one format's direct-cast and QAT models into Hugging Face model directories.

    python stages/pack_safetensors.py --format s3d8

``models/packed/<format>/direct-cast/`` (the teacher's weights cast straight to the format) and
``models/packed/<format>/qat/`` (the QAT student's fp32 masters), each a Hugging Face directory
(``pipeline/hf/quantizer.py``): ``config.json`` with a ``quantization_config``, the processor files,
``generation_config.json``, a model card and ``model.safetensors`` laid out as SPEC section 7 (S3D8:
readable by the Llama-Mobile reference loader) or our documented scalar layout, sharded with an index above
``pipeline.hf.config.MAX_SHARD_SIZE``. Streams tensor by tensor; S3D8 uses the native encoder. Sizes and bits per
parameter go to ``reports/pack/<format>.json``. The direct cast is stage direct-cast's
(``models/direct-cast/<format>/``, cast by ``pack.algorithm``), packed as it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)

from pipeline import formats, params
from pipeline.files.atomic import write_json
from pipeline.pack_run import METHODS, pack_models
from pipeline.cast.ptq import PackParams
from pipeline.stage import stage_errors
from pipeline.teacher.source import TeacherParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, help=f"one of {', '.join(formats.QUANTISED)}")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="which models to pack, comma-separated (default: both; 'direct-cast' alone packs a direct "
                             "cast before any QAT, to score it; needs --out)")
    parser.add_argument("--out", default="models/packed",
                        help="the folder above <format>/ (default models/packed, the stage's output); any other "
                             "leaves reports/pack/ alone and prints the report")
    args = parser.parse_args(argv)
    with stage_errors("pack-safetensors"):
        fmt = formats.comparison(args.format, "--format")
        methods = tuple(m for m in args.methods.split(",") if m)
        stage_output = Path(args.out).resolve() == Path("models/packed").resolve()
        if stage_output and set(methods) != set(METHODS):
            parser.error("--methods without both models replaces the stage's models/packed/: give --out too")
        p = params.load(PackParams, "pack", args.params)
        teacher = params.load(TeacherParams, "teacher", args.params)
        report = pack_models(fmt, p, teacher, methods, args.out)
        if stage_output:
            write_json(f"reports/pack/{fmt.name}.json", report)
        else:
            print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
