"""The default DVC remote (.dvc/config): a local directory under the user's home that `dvc push` fills from
one clone and `dvc pull` restores into another, with the run cache; `.dvc/config.local` points it elsewhere.

Each test builds a tiny DVC project (one stage, one cached and one uncached output) in a temporary
directory, with the project's real `.dvc/config` copied in, and HOME pointed into the temporary directory,
so `~/.cache/s3d8-pipeline/dvc-remote` resolves there and nothing outside it is touched.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REMOTE_IN_HOME = Path(".cache/s3d8-pipeline/dvc-remote")

GEN = """\
import json, os, pathlib, yaml
n = yaml.safe_load(open("params.yaml"))["n"]
pathlib.Path("out").mkdir(exist_ok=True)
pathlib.Path("out/data.txt").write_text("x" * n + "\\n")
pathlib.Path("metrics.json").write_text(json.dumps({"n": n}))
with open(os.environ["RUN_LOG"], "a") as log:   # outside the project: one line per real run
    log.write(f"gen{n}\\n")
"""

COUNT = """\
import os, pathlib, yaml
m = yaml.safe_load(open("params.yaml"))["m"]
pathlib.Path("out/count.txt").write_text(f"{m}\\n")
with open(os.environ["RUN_LOG"], "a") as log:
    log.write(f"count{m}\\n")
"""

# `gen` is shaped like most real stages (a cached output plus a `cache: false` report committed to git);
# `count` has cached outputs only.
DVC_YAML = """\
stages:
  gen:
    cmd: python gen.py
    deps:
      - gen.py
    params:
      - n
    outs:
      - out/data.txt
    metrics:
      - metrics.json:
          cache: false
  count:
    cmd: python count.py
    deps:
      - count.py
    params:
      - m
    outs:
      - out/count.txt
"""


@pytest.fixture()
def env(tmp_path):
    """An environment whose HOME, DVC global/site config and git identity live in tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    e = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "GIT_", "XDG_"))}
    e.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
             DVC_NO_ANALYTICS="1", DVC_SITE_CACHE_DIR=str(tmp_path / "dvc-site"),
             DVC_GLOBAL_CONFIG_DIR=str(home / ".config" / "dvc"), DVC_SYSTEM_CONFIG_DIR=str(tmp_path / "dvc-system"),
             GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
             GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com",
             GIT_CONFIG_GLOBAL=str(tmp_path / "gitconfig"), GIT_CONFIG_NOSYSTEM="1",
             RUN_LOG=str(tmp_path / "runs.log"),
             PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return e


def sh(cwd: Path, env: dict, *cmd: str) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def dvc(cwd: Path, env: dict, *args: str) -> str:
    return sh(cwd, env, sys.executable, "-m", "dvc", *args)


def runs(env: dict) -> list[str]:
    log = Path(env["RUN_LOG"])
    return log.read_text().split() if log.exists() else []


def make_project(path: Path, env: dict) -> Path:
    path.mkdir()
    sh(path, env, "git", "init", "-q", "-b", "main")
    dvc(path, env, "init", "-q")
    shutil.copy(ROOT / ".dvc" / "config", path / ".dvc" / "config")    # the real remote configuration
    (path / "gen.py").write_text(GEN)
    (path / "count.py").write_text(COUNT)
    (path / "params.yaml").write_text("n: 3\nm: 1\n")
    (path / "dvc.yaml").write_text(DVC_YAML)
    return path


def commit(path: Path, env: dict, message: str) -> None:
    sh(path, env, "git", "add", "-A")
    sh(path, env, "git", "commit", "-q", "-m", message)


def setup_remote_step() -> str:
    """The Python that setup.sh runs to create the default remote directory (its DVC_REMOTE here-document)."""
    text = (ROOT / "setup.sh").read_text()
    match = re.search(r"<<'DVC_REMOTE'\n(.*?)\nDVC_REMOTE\n", text, re.S)
    assert match, "setup.sh no longer creates the DVC remote directory (DVC_REMOTE here-document)"
    return match.group(1)


def test_default_remote_is_a_local_directory_under_home():
    from dvc.config import Config

    conf = Config(dvc_dir=str(ROOT / ".dvc"), validate=True)
    name = conf["core"]["remote"]
    # The url is written as ~/..., so clones in different directories (and users) resolve it alike.
    raw = (ROOT / ".dvc" / "config").read_text()
    assert re.search(r"url\s*=\s*~/\.cache/s3d8-pipeline/dvc-remote\s*$", raw, re.M), raw
    assert conf["remote"][name]["url"] == os.path.expanduser("~/.cache/s3d8-pipeline/dvc-remote")


def test_push_from_one_clone_pull_into_a_fresh_clone(tmp_path, env):
    home = Path(env["HOME"])
    origin = make_project(tmp_path / "origin", env)
    # setup.sh creates the remote directory that DVC resolves from the config.
    sh(origin, env, sys.executable, "-c", setup_remote_step())
    remote = home / REMOTE_IN_HOME
    assert remote.is_dir()

    dvc(origin, env, "repro")
    assert runs(env) == ["gen3", "count1"]
    commit(origin, env, "n=3, m=1")
    dvc(origin, env, "push")
    assert any((remote / "files" / "md5").rglob("*")), "no objects pushed"
    # An experiment that is not committed (its dvc.lock is thrown away): pushed with its run cache.
    (origin / "params.yaml").write_text("n: 5\nm: 7\n")
    dvc(origin, env, "repro")
    assert runs(env) == ["gen3", "count1", "gen5", "count7"]
    dvc(origin, env, "push", "--run-cache")
    assert any((remote / "runs").rglob("*")), "run cache not pushed"
    sh(origin, env, "git", "checkout", "-q", "--", "params.yaml", "dvc.lock", "metrics.json")

    # A fresh clone: pull restores the committed outputs; nothing is left to run.
    clone = tmp_path / "clone"
    sh(tmp_path, env, "git", "clone", "-q", str(origin), str(clone))
    assert not (clone / "out" / "data.txt").exists()
    dvc(clone, env, "pull")
    assert (clone / "out" / "data.txt").read_text() == "xxx\n"
    assert (clone / "out" / "count.txt").read_text() == "1\n"
    assert "up to date" in dvc(clone, env, "status")
    out = dvc(clone, env, "repro")
    assert "up to date" in out, out
    assert len(runs(env)) == 4, f"a stage re-ran after dvc pull: {runs(env)}"

    # The run cache: the experiment's parameters have no dvc.lock in git, but its runs were pushed with
    # --run-cache, so `dvc repro --pull` (which fetches the run cache and the objects it names) restores
    # `count`'s output instead of running it. `gen` runs again: DVC 3.67 pushes run-cache entries but not
    # the cache copy of a `cache: false` output (metrics.json), so a stage with such an output can be
    # restored only from a local cache that holds it.
    (clone / "params.yaml").write_text("n: 5\nm: 7\n")
    out = dvc(clone, env, "repro", "--pull")
    assert "Stage 'count' is cached - skipping run" in out, out
    assert runs(env)[4:] == ["gen5"], runs(env)
    assert (clone / "out" / "count.txt").read_text() == "7\n"
    assert (clone / "out" / "data.txt").read_text() == "xxxxx\n"

    # In the project that ran it, with its local cache, the run cache restores both stages.
    (origin / "params.yaml").write_text("n: 5\nm: 7\n")
    out = dvc(origin, env, "repro")
    assert "Stage 'gen' is cached - skipping run" in out and "Stage 'count' is cached - skipping run" in out, out
    assert runs(env)[5:] == [], runs(env)
    assert (origin / "metrics.json").read_text() == '{"n": 5}'


def test_config_local_points_the_remote_elsewhere(tmp_path, env):
    project = make_project(tmp_path / "project", env)
    elsewhere = tmp_path / "elsewhere" / "remote"
    dvc(project, env, "remote", "modify", "--local", "local", "url", str(elsewhere))
    sh(project, env, sys.executable, "-c", setup_remote_step())
    assert elsewhere.is_dir()
    dvc(project, env, "repro")
    dvc(project, env, "push")
    assert any((elsewhere / "files" / "md5").rglob("*"))
    assert not (Path(env["HOME"]) / REMOTE_IN_HOME).exists()
    # Or a remote of one's own, made the default in .dvc/config.local.
    mine = tmp_path / "mine"
    dvc(project, env, "remote", "add", "--local", "-d", "mine", str(mine))
    dvc(project, env, "push")
    assert any((mine / "files" / "md5").rglob("*"))
