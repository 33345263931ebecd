"""The installable package: metadata, the wheel's contents, a fresh-venv install and its `s3d8` command,
the editable install of setup.sh.

The wheel and editable builds run on a copy of the package's sources in a temporary directory (never in
the working tree: an in-place build there would rewrite pipeline/_s3d8_native*.so under running tests).
The fresh venvs reuse .venv's third-party packages through a .pth file pointing at a view of its
site-packages without this project (or with only the wheel's core dependencies, to show that a plain install
runs a packed model), so nothing is downloaded and .venv is never touched."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.stage_helpers import REPO

SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE", "README.md", "native", "pipeline",
           "data/prompts/prompt_pool.yaml")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.so", "*.o", "_build", "*.egg-info", "*.pyc")


# The core: what loading and running a packed model needs (import pipeline and transformers' from_pretrained,
# pipeline.runtime.generation, the native kernels, s3d8 pack / generate / export-sqt / bench). The rest are extras.
CORE = {"torch", "transformers", "tokenizers", "huggingface-hub", "safetensors", "cffi", "numpy", "pillow", "pyyaml",
        "jinja2", "rich"}
EXTRAS = {
    "eval": {"pyarrow", "datasets"},
    "pipeline": {"dvc", "dvclive", "accelerate", "ruamel-yaml", "matplotlib", "gguf", "pyarrow", "datasets"},
    "bench": {"llama-cpp-python", "gguf"},
    "serve": {"starlette", "uvicorn"},
    "dev": {"pytest", "hypothesis", "dvc", "dvclive", "datasets", "matplotlib", "starlette", "uvicorn", "openai"},
}
HEAVY = {"dvc", "dvclive", "datasets", "matplotlib", "pyarrow", "accelerate", "pandas", "llama-cpp-python"}


def _name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def _pins(file: str) -> set[str]:
    return {canonicalize_name(line.split("==")[0]) for line in (REPO / file).read_text().splitlines()
            if "==" in line and not line.lstrip().startswith("#")}


def _extra(optional: dict[str, list[str]], extra: str) -> set[str]:
    """The distribution names of one extra, its references to other extras of s3d8-pipeline followed."""
    names = set()
    for r in optional[extra]:
        req = Requirement(r)
        if canonicalize_name(req.name) == "s3d8-pipeline":
            for other in req.extras:
                names |= _extra(optional, other)
        else:
            names.add(canonicalize_name(req.name))
    return names


def _closure(requirements, installed_only: bool = False) -> set[str]:
    """Distribution names that installing ``requirements`` brings (each one's own requirements, markers
    evaluated here), from the metadata of what is installed in this interpreter (``installed_only``: skip
    what is not installed, else that is an error)."""
    from importlib import metadata

    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or name == "s3d8-pipeline":
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if installed_only:
                continue
            raise
        seen.add(name)
        for r in dist.requires or []:
            sub = Requirement(r)
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return seen


def test_pyproject_metadata():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["readme"] == "README.md"
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0, January 2004" in (REPO / "LICENSE").read_text()
    assert project["scripts"] == {"s3d8": "pipeline.cli:main"}
    deps = {_name(d): d for d in project["dependencies"]}
    assert re.fullmatch(r"torch>=2\.\d+", deps["torch"])
    every = [*project["dependencies"], *(r for reqs in project["optional-dependencies"].values() for r in reqs)]
    assert not [r for r in every if "==" in r], "exact pins belong in requirements.lock"
    pinned = _pins("requirements.lock") | _pins("requirements-bench.txt")
    unpinned = {_name(r) for r in every} - pinned - {"s3d8-pipeline"}
    assert not unpinned, f"not pinned in requirements.lock or requirements-bench.txt: {sorted(unpinned)}"
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    assert any(r.startswith("cffi") for r in build)


def test_dependencies_split_core_from_extras():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {_name(d) for d in project["dependencies"]}
    assert core == CORE, f"core dependencies: {sorted(core)}"
    optional = project["optional-dependencies"]
    assert set(optional) == set(EXTRAS)
    for extra, expected in EXTRAS.items():
        names = _extra(optional, extra)
        assert expected <= names, f"[{extra}] lacks {sorted(expected - names)}"
        assert not names & core, f"[{extra}] repeats core dependencies {sorted(names & core)}"
    # a plain install pulls none of the pipeline's heavy packages, not even through the core's own requirements
    pulled = _closure(project["dependencies"])
    assert not pulled & HEAVY, f"the core pulls {sorted(pulled & HEAVY)}"
    assert len(pulled) < 60, f"the core pulls {len(pulled)} distributions"


def _extras_only_modules() -> list[str]:
    """Top-level modules of the distributions that only the extras bring (not the core's closure)."""
    from importlib import metadata

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = _closure(project["dependencies"])
    extras = set()
    for extra in project["optional-dependencies"]:
        extras |= _closure(project["optional-dependencies"][extra], installed_only=True)
    only = extras - core
    return sorted(top for top, dists in metadata.packages_distributions().items()
                  if not top.startswith("_") and all(canonicalize_name(d) in only for d in dists))


def test_a_packed_model_runs_without_the_extras(tmp_path):
    """pack, generate (with an image) and export-sqt in a process where every module that only the extras
    install is missing (as in an install of the core alone)."""
    from tests.stage_helpers import build_tiny_teacher

    blocked = _extras_only_modules()
    assert {"dvc", "dvclive", "datasets", "matplotlib", "pyarrow", "accelerate"} <= set(blocked)
    teacher = build_tiny_teacher(tmp_path / "teacher")
    from PIL import Image

    Image.new("RGB", (40, 30), (200, 30, 30)).save(tmp_path / "red.png")
    script = f"""
import sys
for name in {blocked!r}:
    sys.modules[name] = None                   # import NAME raises ImportError, find_spec(NAME) is None
import pipeline, pipeline.hf.quantizer, pipeline.runtime.generation, pipeline.packed.file, pipeline.native, pipeline.sqt.write
from pipeline.cli import main
out = {str(tmp_path)!r}
assert main(["pack", {str(teacher)!r}, out + "/packed"]) == 0
assert main(["generate", out + "/packed", "--prompt", "Which colour?", "--image", out + "/red.png",
             "--max-new-tokens", "3", "--threads", "1"]) == 0
assert main(["generate", out + "/packed", "--prompt", "Hello", "--max-new-tokens", "3", "--threads", "1"]) == 0
assert main(["export-sqt", out + "/packed", out + "/model.sqt"]) == 0
import torch
from transformers import AutoModelForImageTextToText
model = AutoModelForImageTextToText.from_pretrained(out + "/packed")
print("logits", tuple(model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape))
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert len([line for line in r.stderr.splitlines() if "tokens/s" in line]) == 2   # one per generate
    assert (tmp_path / "model.sqt").is_file()
    assert re.search(r"^logits \(1, 3, \d+\)$", r.stdout, re.M)


def test_eval_without_its_extra_says_what_to_install(tmp_path):
    script = ("import sys\nfor name in ('pyarrow', 'datasets'):\n    sys.modules[name] = None\n"
              "from pipeline.cli import main\nsys.exit(main(['eval', 'model.safetensors']))")
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert "s3d8 eval" in r.stderr and "pyarrow" in r.stderr and "[eval]" in r.stderr


def test_native_build_script_offers_the_cffi_builder():
    import importlib.util

    import cffi

    spec = importlib.util.spec_from_file_location("native_build", REPO / "native" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ffi = mod.ffibuilder()
    assert isinstance(ffi, cffi.FFI) and ffi._assigned_source[0] == "pipeline._s3d8_native"
    assert ffi._assigned_source[3]["py_limited_api"] is False


def test_cli_help_and_generate_without_runtime(capsys, monkeypatch):
    from pipeline import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("pack", "eval", "export-sqt", "bench", "generate"):
        assert command in out
    assert cli.main(["bench", "--shape", "1,x,3"]) == 1
    assert "--shape '1,x,3': expected m,k,n" in capsys.readouterr().err
    import pipeline

    import pipeline.runtime

    monkeypatch.setitem(sys.modules, "pipeline.runtime.generation", None)      # as if the module were missing
    monkeypatch.delattr(pipeline.runtime, "generation", raising=False)         # (another test may have imported it)
    assert cli.main(["generate", "model", "--prompt", "hi"]) == 1     # the CLI's one exit status for errors
    assert "s3d8 generate needs pipeline.runtime.generation" in capsys.readouterr().err


# --- building and installing (slow) -------------------------------------------------------------------------


def _copy_sources(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in SOURCES:
        src = REPO / name
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=_IGNORE)
        else:
            shutil.copy2(src, dst / name)
    return dst


def _run(cmd, cwd, timeout=600, env=None):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _fresh_venv(path: Path, only: set[str] | None = None) -> Path:
    """A new venv (no packages of its own) that sees .venv's third-party packages, pip and setuptools
    included, through a view of its site-packages without this project; with ``only`` (distribution names),
    the view holds those distributions (and pip) alone: an install of just those."""
    from importlib import metadata

    _run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent)
    site = Path(sysconfig.get_paths()["purelib"])
    view = path.parent / f"{path.name}-deps"
    view.mkdir()
    if only is None:
        entries = {e.name for e in site.iterdir()}
    else:
        entries = set()
        for name in only | {"pip"}:
            for file in metadata.distribution(name).files or []:
                top = Path(str(file)).parts[0]
                if top not in ("..", "__pycache__"):
                    entries.add(top)
    for name in sorted(entries):
        if name.startswith(("s3d8_pipeline", "__editable__", "_s3d8")) or name.endswith(".pth") \
                or name == "pipeline" or not (site / name).exists():
            continue
        (view / name).symlink_to(site / name)
    py = path / "bin" / "python"
    fresh_site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], path).stdout.strip())
    (fresh_site / "zz-s3d8-test-deps.pth").write_text(f"{view}\n")
    return py


def _metadata(wheel: Path) -> tuple[list[str], dict[str, set[str]]]:
    """The wheel's core Requires-Dist and, per Provides-Extra, the distribution names that extra brings (its
    references to the package's other extras, ``s3d8-pipeline[...]``, followed)."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    headers = meta.split("\n\n", 1)[0].splitlines()
    requires = [Requirement(h.split(": ", 1)[1]) for h in headers if h.startswith("Requires-Dist: ")]
    extras = [h.split(": ", 1)[1] for h in headers if h.startswith("Provides-Extra: ")]

    def brings(extra: str) -> set[str]:
        names = set()
        for req in requires:
            if req.marker is not None and req.marker.evaluate({"extra": extra}):
                if canonicalize_name(req.name) == "s3d8-pipeline":
                    names |= set().union(*(brings(e) for e in req.extras))
                else:
                    names.add(canonicalize_name(req.name))
        return names

    return [str(r) for r in requires if r.marker is None], {e: brings(e) for e in extras}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    root = tmp_path_factory.mktemp("package")
    src = _copy_sources(root / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", src, "-w", root / "dist"],
         cwd=root)
    (whl,) = (root / "dist").glob("s3d8_pipeline-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_contents(wheel):
    assert re.fullmatch(r"s3d8_pipeline-0\.1\.0-cp3\d+-cp3\d+-linux_\w+\.whl", wheel.name), "a platform wheel"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert [n for n in names if re.fullmatch(r"pipeline/_s3d8_native\.cpython-\d+-[\w-]+\.so", n)]
        assert "pipeline/toy/chat_template.jinja" in names
        assert z.read("pipeline/data/prompt_pool.yaml") == (REPO / "data/prompts/prompt_pool.yaml").read_bytes()
        assert "pipeline/sqt/write.py" in names and "pipeline/cli.py" in names
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "s3d8 = pipeline.cli:main" in z.read(info).decode()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert "License-Expression: Apache-2.0" in meta and "Requires-Dist: torch>=2.4" in meta
        assert any(n.endswith("licenses/LICENSE") for n in names)
        assert not [n for n in names if n.startswith(("tests/", "native/", "data/", "stages/"))]
    # a plain install of the wheel: the core alone; the pipeline, evaluation and benchmarks are extras
    core, extras = _metadata(wheel)
    assert {_name(r) for r in core} == CORE
    assert set(extras) == set(EXTRAS)
    for extra, expected in EXTRAS.items():
        assert expected <= extras[extra], f"[{extra}] of the wheel lacks {sorted(expected - extras[extra])}"


@pytest.mark.slow
def test_wheel_installs_and_runs_with_only_its_core_dependencies(wheel, tmp_path):
    """The wheel in a venv that holds its core dependencies alone (none of the extras): pip finds them all
    (--no-index, dependencies resolved), and the library and CLI work without the repository."""
    core, _ = _metadata(wheel)
    py = _fresh_venv(tmp_path / "venv", only=_closure(core))
    _run([py, "-m", "pip", "install", "--no-index", wheel], cwd=tmp_path)
    missing = _run([py, "-c", "import importlib.util as u; print([m for m in ('dvc', 'dvclive', 'datasets', "
                    "'matplotlib', 'pyarrow', 'accelerate', 'pytest') if u.find_spec(m)])"], cwd=tmp_path).stdout
    assert missing.strip() == "[]", f"the core venv has {missing}"
    work = tmp_path / "work"        # no repository anywhere near: run from an empty directory
    work.mkdir()
    s3d8 = tmp_path / "venv" / "bin" / "s3d8"
    assert "export-sqt" in _run([s3d8, "--help"], cwd=work).stdout
    probe = _run([py, "-c", "import pipeline, pipeline.native as n, pipeline.teacher.prompts as p;"
                  "import importlib.resources as r;"
                  "import pipeline.hf.quantizer, pipeline.runtime.generation, pipeline.packed.file;"
                  "print(pipeline.__file__); print(n.variant());"
                  "pool = r.files('pipeline') / 'data' / 'prompt_pool.yaml';"
                  "print(len(p.load_pool(str(pool)).prompts));"
                  "print((r.files('pipeline') / 'toy' / 'chat_template.jinja').is_file())"], cwd=work).stdout.split()
    assert probe[0].startswith(str(tmp_path / "venv")) and probe[1] in ("scalar", "avx2", "avx512", "neon")
    assert int(probe[2]) > 100 and probe[3] == "True"
    # the CLI on the toy teacher (committed in data/toy-teacher): pack it (native encoder), generate with an
    # image and without, export the .sqt, check it
    teacher = REPO / "data" / "toy-teacher"
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    out = _run([s3d8, "pack", teacher, work / "packed"], cwd=work, env=env).stdout
    assert "bits/param" in out and (work / "packed" / "tokenizer.json").is_file()
    _run([py, "-c", "from PIL import Image; Image.new('RGB', (64, 48), (200, 30, 30)).save('red.png')"], cwd=work)
    for image in (["--image", "red.png"], []):
        r = _run([s3d8, "generate", work / "packed", "--prompt", "Which colour is the shape?", *image,
                  "--max-new-tokens", "4", "--threads", "1"], cwd=work, env=env)
        assert "tokens/s" in r.stderr
    out = _run([s3d8, "export-sqt", work / "packed", work / "model.sqt"], cwd=work, env=env).stdout
    assert "version 3" in out and "OK" in out
    assert "OK" in _run([py, "-m", "pipeline.sqt.write", "check", work / "model.sqt"], cwd=work, env=env).stdout
    assert "GMAC/s" in _run([s3d8, "bench", "--shape", "1,64,48", "--seconds", "0.05"], cwd=work, env=env).stdout
    logits = _run([py, "-c", "import pipeline, torch; from transformers import AutoModelForImageTextToText as A;"
                   "m = A.from_pretrained('packed'); print(tuple(m(input_ids=torch.tensor([[5, 6, 7]])).logits.shape))"],
                  cwd=work, env=env).stdout
    assert re.fullmatch(r"\(1, 3, \d+\)\n", logits), logits


def _setup_sh_install(src: Path, py: Path) -> list:
    """setup.sh's command that installs the project, run by ``py`` on the sources ``src``."""
    import shlex

    (line,) = [ln for ln in (REPO / "setup.sh").read_text().splitlines()
               if ln.startswith(".venv/bin/pip install") and " -e " in ln]
    args = shlex.split(line)[1:]          # after .venv/bin/pip; "." or ".[extras]" is the repository
    return [py, "-m", "pip", *(f"{src}{a[1:]}" if a == "." or a.startswith(".[") else a for a in args)]


@pytest.mark.slow
def test_editable_install_as_setup_sh_does(tmp_path):
    src = _copy_sources(tmp_path / "src")
    py = _fresh_venv(tmp_path / "venv")
    # setup.sh's command (the project and its extras from the packages requirements.lock installed: nothing is
    # downloaded); setuptools and cffi come from .venv (no build isolation)
    cmd = _setup_sh_install(src, py)
    assert "--no-index" in cmd and any(str(c).startswith(f"{src}[") and "pipeline" in str(c) for c in cmd)
    _run(cmd, cwd=src)
    built = list((src / "pipeline").glob("_s3d8_native.cpython-*.so"))
    assert len(built) == 1, "the editable install builds the extension in place"
    probe = _run([py, "-c", "import pipeline, pipeline.native as n; print(pipeline.__file__); print(n.variant())"],
                 cwd=tmp_path).stdout.split()
    assert probe[0] == str(src / "pipeline" / "__init__.py")
    # and native/build.py, which setup.sh runs next, finds it up to date or rebuilds it, as before
    out = _run([py, src / "native" / "build.py"], cwd=src).stdout
    assert "native/build.py:" in out
    assert "s3d8" in _run([tmp_path / "venv" / "bin" / "s3d8", "--help"], cwd=tmp_path).stdout
