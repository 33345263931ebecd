"""DVC stage export-sqt: the packed S3D8 models as the Llama-Mobile engine's ``.sqt`` version 3 files (SPEC
section 9), ready for the reference C++ engine.

    python stages/export_sqt.py

Reads ``models/packed/s3d8/{direct-cast,qat}/`` and writes ``models/sqt/s3d8-{direct-cast,qat}.sqt``, each
checked by the reader after writing. A model the engine cannot run (a tokenizer without Llama 3's chat tokens,
such as SmolLM2's) gets ``models/sqt/NOT-EXPORTED.txt`` with the reason instead. ``created`` in the file's
metadata is ``$SOURCE_DATE_EPOCH`` (0 unless set), so the same packed model always gives the same bytes.
"""

from __future__ import annotations

import argparse
import os

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
from pipeline.files.atomic import atomic_dir
from pipeline.recipe import STUDENTS
from pipeline.sqt.write import export
from pipeline.sqt.blocks import SqtUnsupported
from pipeline.sqt.read import read_sqt, summary
from pipeline.stage import console, stage_errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packed", default="models/packed/s3d8", help="directory of the packed S3D8 models")
    parser.add_argument("--out", default="models/sqt")
    args = parser.parse_args(argv)
    with stage_errors("export-sqt"):
        os.environ.setdefault("SOURCE_DATE_EPOCH", "0")
        with atomic_dir(args.out) as out:
            for method in STUDENTS:
                target = out / f"s3d8-{method}.sqt"
                try:
                    export(f"{args.packed}/{method}", target)
                except SqtUnsupported as e:  # a model the engine cannot run: say so in the output, not a red DAG
                    (out / "NOT-EXPORTED.txt").write_text(f"{e}\n")
                    console.print(f"[yellow]export-sqt: nothing exported: {e}[/yellow]")
                    break
                console.print(summary(read_sqt(target)).replace(str(target), f"{args.out}/{target.name}"))


if __name__ == "__main__":
    main()
