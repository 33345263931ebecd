"""The project modules a script imports, followed transitively: what its DVC stage must list as deps.

``python -m pipeline.depgraph stages/eval.py`` prints them; ``tests/test_dvc_graph.py`` checks that every
stage of ``dvc.yaml`` lists each one (a file, or a directory holding it). Imports are read from the source
(every ``import`` statement, including those inside functions), not executed.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE_SOURCES = ("native/build.py", "native/s3d8.h", "native/s3d8_internal.h", "native/s3d8_encode_impl.h",
                  "native/s3d8_ref.c", "native/s3d8_dispatch.c", "native/s3d8_avx2.c", "native/s3d8_avx512.c",
                  "native/s3d8_neon.c")
"""What the compiled library behind ``pipeline/native.py`` is built from."""


def _module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] == "pipeline"}


def project_imports(script: str | Path) -> list[str]:
    """Project files (relative to the repository root) that ``script`` imports, transitively, itself included;
    a package's ``__init__.py`` comes with each of its modules (Python runs it on import)."""
    seen: set[Path] = set()
    todo = [ROOT / script]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):           # parent packages run their __init__ too
                f = _module_file(".".join(parts[:i]))
                if f is not None and f not in seen:
                    todo.append(f)
    files = {str(p.relative_to(ROOT)) for p in seen}
    if "pipeline/native.py" in files:
        files.update(NATIVE_SOURCES)
    return sorted(files)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}:")
        for f in project_imports(arg):
            print(f"  - {f}")
