"""DVC stage teacher-import: the teacher as the bf16 Hugging Face directory every later stage reads.

    python stages/teacher_import.py

Reads ``teacher.source`` (a local Hugging Face directory, a hub id, a ``.gguf`` file or
``gguf:<pip distribution>:<file>``) and writes ``teacher.dir`` (config, ``model.safetensors`` in bf16, tokenizer
and chat template, generation config, ``teacher_import.json`` naming the source, its package version and hash),
replaced whole. ``teacher.rotate`` (orthogonal | hadamard) rotates a text Llama's residual stream on the way
(``pipeline.cast.rotate``: the same function, in float32; set ``teacher.dtype: float32`` so that stages compute with it
unrounded). The same as ``python -m pipeline.teacher import SOURCE OUT_DIR [--rotate KIND]``.
"""

from __future__ import annotations

import argparse

import pipeline.cpu_numerics  # noqa: F401  (first: one CPU code path, the same bytes on any x86-64)
from pipeline import params
from pipeline.stage import console, stage_errors
from pipeline.teacher.importer import import_teacher
from pipeline.teacher.source import TeacherParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    with stage_errors("teacher-import"):
        teacher = params.load(TeacherParams, "teacher", args.params)
        if teacher.rotate != "none" and teacher.dtype != "float32":
            raise ValueError(f"parameter teacher.rotate={teacher.rotate} needs teacher.dtype: float32 (is "
                             f"{teacher.dtype}): the rotated teacher is exact only unrounded")
        record = import_teacher(teacher.source, teacher.dir, teacher.rotate, teacher.rotate_seed)       # a SourceError is a ValueError: one line
        rotated = f", rotated: {teacher.rotate}" if teacher.rotate != "none" else ""
        console.print(f"[green]teacher-import[/] {teacher.source} -> {teacher.dir} ({record['kind']}{rotated})")


if __name__ == "__main__":
    main()
