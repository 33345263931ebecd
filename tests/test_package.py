"""The installable package: metadata, the wheel's contents, a fresh-venv install and its `s3d8` command,
the editable install of setup.sh.

The wheel and editable builds run on a copy of the package's sources in a temporary directory (never in
the working tree: an in-place build there would rewrite pipeline/_s3d8_native*.so under running tests).
The fresh venvs reuse .venv's third-party packages through a .pth file pointing at a view of its
site-packages without this project, so nothing is downloaded and .venv is never touched."""

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

from tests.stage_helpers import REPO

SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE", "README.md", "native", "pipeline",
           "data/prompts/prompt_pool.yaml")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.so", "*.o", "_build", "*.egg-info", "*.pyc")


def test_pyproject_metadata():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["readme"] == "README.md"
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0, January 2004" in (REPO / "LICENSE").read_text()
    assert project["scripts"] == {"s3d8": "pipeline.cli:main"}
    deps = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower(): d for d in project["dependencies"]}
    assert "==" not in "".join(deps.values()), "exact pins belong in requirements.lock"
    assert re.fullmatch(r"torch>=2\.\d+", deps["torch"])
    lock = {line.split("==")[0].lower() for line in (REPO / "requirements.lock").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    assert set(deps) <= lock | {n.replace("_", "-") for n in lock}, "every dependency is pinned in requirements.lock"
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    assert any(r.startswith("cffi") for r in build)


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
    import pipeline

    monkeypatch.setitem(sys.modules, "pipeline.runtime", None)      # as if the module were missing
    monkeypatch.delattr(pipeline, "runtime", raising=False)         # (another test may have imported it)
    assert cli.main(["generate", "model", "--prompt", "hi"]) == 2
    assert "s3d8 generate needs pipeline.runtime" in capsys.readouterr().err
    assert cli.main(["bench", "--shape", "1,x,3"]) == 1
    assert "--shape '1,x,3': expected m,k,n" in capsys.readouterr().err


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


def _fresh_venv(path: Path) -> Path:
    """A new venv (no packages of its own) that sees .venv's third-party packages, pip and setuptools
    included, through a view of its site-packages without this project."""
    _run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent)
    site = Path(sysconfig.get_paths()["purelib"])
    view = path.parent / f"{path.name}-deps"
    view.mkdir()
    for entry in site.iterdir():
        if entry.name.startswith(("s3d8_pipeline", "__editable__", "_s3d8")) or entry.suffix == ".pth" \
                or entry.name == "pipeline":
            continue
        (view / entry.name).symlink_to(entry)
    py = path / "bin" / "python"
    fresh_site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], path).stdout.strip())
    (fresh_site / "zz-s3d8-test-deps.pth").write_text(f"{view}\n")
    return py


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
        assert "pipeline/sqt.py" in names and "pipeline/cli.py" in names
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "s3d8 = pipeline.cli:main" in z.read(info).decode()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert "License-Expression: Apache-2.0" in meta and "Requires-Dist: torch>=2.4" in meta
        assert any(n.endswith("licenses/LICENSE") for n in names)
        assert not [n for n in names if n.startswith(("tests/", "native/", "data/", "stages/"))]


@pytest.mark.slow
def test_wheel_installs_and_runs_without_the_repository(wheel, tmp_path):
    py = _fresh_venv(tmp_path / "venv")
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", wheel], cwd=tmp_path)
    work = tmp_path / "work"        # no repository anywhere near: run from an empty directory
    work.mkdir()
    s3d8 = tmp_path / "venv" / "bin" / "s3d8"
    assert "export-sqt" in _run([s3d8, "--help"], cwd=work).stdout
    probe = _run([py, "-c", "import pipeline, pipeline.native as n, pipeline.prompts as p, importlib.resources as r;"
                  "print(pipeline.__file__); print(n.variant());"
                  "pool = r.files('pipeline') / 'data' / 'prompt_pool.yaml';"
                  "print(len(p.load_pool(str(pool)).prompts));"
                  "print((r.files('pipeline') / 'toy' / 'chat_template.jinja').is_file())"], cwd=work).stdout.split()
    assert probe[0].startswith(str(tmp_path / "venv")) and probe[1] in ("scalar", "avx2", "avx512", "neon")
    assert int(probe[2]) > 100 and probe[3] == "True"
    # the CLI on the toy teacher (committed in data/toy-teacher): pack it (native encoder), export the .sqt, check it
    teacher = REPO / "data" / "toy-teacher"
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    out = _run([s3d8, "pack", teacher, work / "packed"], cwd=work, env=env).stdout
    assert "bits/param nominal" in out and (work / "packed" / "tokenizer.json").is_file()
    out = _run([s3d8, "export-sqt", work / "packed", work / "model.sqt"], cwd=work, env=env).stdout
    assert "version 3" in out and "OK" in out
    assert "OK" in _run([py, "-m", "pipeline.sqt", "check", work / "model.sqt"], cwd=work, env=env).stdout
    assert "GMAC/s" in _run([s3d8, "bench", "--shape", "1,64,48", "--seconds", "0.05"], cwd=work, env=env).stdout


@pytest.mark.slow
def test_editable_install_as_setup_sh_does(tmp_path):
    src = _copy_sources(tmp_path / "src")
    py = _fresh_venv(tmp_path / "venv")
    # setup.sh's command; setuptools and cffi come from .venv (no build isolation)
    _run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", src], cwd=src)
    built = list((src / "pipeline").glob("_s3d8_native.cpython-*.so"))
    assert len(built) == 1, "the editable install builds the extension in place"
    probe = _run([py, "-c", "import pipeline, pipeline.native as n; print(pipeline.__file__); print(n.variant())"],
                 cwd=tmp_path).stdout.split()
    assert probe[0] == str(src / "pipeline" / "__init__.py")
    # and native/build.py, which setup.sh runs next, finds it up to date or rebuilds it, as before
    out = _run([py, src / "native" / "build.py"], cwd=src).stdout
    assert "native/build.py:" in out
    assert "s3d8" in _run([tmp_path / "venv" / "bin" / "s3d8", "--help"], cwd=tmp_path).stdout
