"""The project modules a script imports, followed transitively: what its DVC stage must list as deps.

``python -m pipeline.depgraph stages/eval.py`` prints them; ``python -m pipeline.depgraph --update dvc.yaml``
rewrites each stage's project deps (keeping its other deps, and the file's comments); ``tests/test_dvc_graph.py``
checks that every stage of ``dvc.yaml`` lists each one (a file, or a directory holding it). Imports are read from the source
(every ``import`` statement, including those inside functions), not executed; those of :data:`NOT_FOLLOWED` are
not followed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _native_sources() -> tuple[str, ...]:
    """What the compiled library behind ``pipeline/native.py`` is built from: ``native/build.py``, the headers and
    every source its ``LIBRARY`` compiles (for any architecture), read from build.py's syntax tree."""
    tree = ast.parse((ROOT / "native" / "build.py").read_text())
    library = next(ast.literal_eval(node.value) for node in tree.body
                   if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "LIBRARY")
    sources = sorted({source for files in library.values() for source in files})
    headers = sorted(p.name for p in (ROOT / "native").glob("*.h"))
    return ("native/build.py", *(f"native/{name}" for name in headers + sources))


NATIVE_SOURCES = _native_sources()

READS = {"pipeline/texts/__init__.py": tuple(sorted(f"pipeline/texts/{p.name}"
                                                   for p in (ROOT / "pipeline" / "texts").glob("*.txt")))}
"""Data files a module reads at run time, listed wherever the module is: what a stage computes from."""


def _module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


NOT_FOLLOWED = {
    "pipeline/__init__.py": ({"pipeline.hf", "pipeline.hf.quantizer"},
                             "the Hugging Face registration, run when transformers is imported: it lets "
                             "from_pretrained load packed directories and changes no stage's result; a stage that "
                             "writes or loads packed directories imports pipeline.hf's modules itself"),
    "pipeline/params.py": ({"pipeline.bench", "pipeline.cast.calibrate", "pipeline.cast.fit", "pipeline.cast.ptq",
                            "pipeline.eval.suite", "pipeline.formats", "pipeline.launch.processes", "pipeline.qat.train",
                            "pipeline.teacher.answers", "pipeline.teacher.generate_answers",
                            "pipeline.teacher.sample", "pipeline.teacher.source", "pipeline.toy.settings"},
                           "every section's schema, to validate the whole params.yaml before a stage works: a "
                           "stage's results depend on its own section's values (its params deps) and the code that "
                           "reads them, which the stage imports itself, not on the other sections' checks"),
    "pipeline/launch/launcher.py": ({"pipeline.launch.memory_plan", "pipeline.launch.ranks"},
                           "the launcher's memory and disk check before a stage starts, and its `plan` command: "
                           "they refuse to start a stage or print a plan and change no stage's result; a stage that "
                           "plans with them imports them itself"),
}
"""Imports the graph does not follow, per file, with the reason (a module, and the names taken from it)."""


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = NOT_FOLLOWED.get(path.relative_to(ROOT).as_posix(), (set(),))[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module not in skip:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] == "pipeline" and n not in skip}


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
    for module, data in READS.items():
        if module in files:
            files.update(data)
    return sorted(files)


def collapsed(files: list[str]) -> list[str]:
    """``files`` with each package directory whose every module is listed written as the directory."""
    out = set(files)
    for init in sorted(f for f in files if f.endswith("/__init__.py")):
        package = init.rsplit("/", 1)[0]
        modules = {str(p.relative_to(ROOT)) for p in (ROOT / package).glob("*.py")}
        if modules <= out and not any(d.startswith(package + "/") for d in out if (ROOT / d).is_dir()):
            out = (out - modules) | {package}
    return sorted(out)


def command_imports(cmd: str) -> list[str]:
    """Project files a stage command runs: its script's imports and, for ``python -m pipeline.X SCRIPT``
    (the launcher), the module's too."""
    import re

    files = set(project_imports(re.search(r"stages/\w+\.py", cmd).group(0)))
    for module in re.findall(r"-m (pipeline(?:\.\w+)+)", cmd):
        main = ROOT / Path(*module.split(".")) / "__main__.py"      # a package runs its __main__
        files.update(project_imports((main if main.is_file() else _module_file(module)).relative_to(ROOT)))
    return sorted(files)


PARAMS_ONLY = {
    "toy-teacher": "its training runs the CPU's own kernels, so a retrain on another CPU gives other weights: the "
                   "committed ones are the reference, retrained only when its parameters change",
}
"""Stages that list no project code as deps, with the reason: ``dvc repro`` re-runs them only when their parameters
or data change (``dvc repro -f STAGE`` after a code change that should reach them)."""


def update(dvc_yaml: str | Path) -> None:
    """Rewrite the project-file deps of every stage of ``dvc_yaml`` from its script's imports (none for the stages
    of :data:`PARAMS_ONLY`)."""
    import io

    from ruamel.yaml import YAML

    from pipeline.files.atomic import write_text

    rt = YAML()
    rt.width = 110
    rt.indent(mapping=2, sequence=4, offset=2)
    doc = rt.load(Path(dvc_yaml).read_text())
    for name, stage in doc["stages"].items():
        deps = stage["deps"]
        other = [d for d in deps if not str(d).startswith(("pipeline/", "stages/", "native/"))]
        deps.clear()
        deps.extend(other if name in PARAMS_ONLY else collapsed(command_imports(stage["cmd"])) + other)
    out = io.StringIO()
    rt.dump(doc, out)
    write_text(dvc_yaml, out.getvalue())


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipeline.depgraph",
                                     description="the project files a script imports, transitively")
    parser.add_argument("scripts", nargs="*", help="scripts to list the imports of (e.g. stages/eval.py)")
    parser.add_argument("--update", metavar="DVC_YAML", nargs="?", const="dvc.yaml",
                        help="rewrite each stage's project deps in DVC_YAML (default dvc.yaml) from its command")
    args = parser.parse_args()
    if args.update:
        update(args.update)
    for arg in args.scripts:
        print(f"{arg}:")
        for f in project_imports(arg):
            print(f"  - {f}")
