#!/usr/bin/env bash
# One-time (idempotent) set-up: virtual environment in .venv/, pinned dependencies, the project in
# editable mode, and the native kernel library. Safe to re-run; it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# requirements.lock pins every package (torch==2.13.0 is the CPU wheel; a looser pin pulls CUDA).
.venv/bin/pip install --quiet --disable-pip-version-check -r requirements.lock
# The project with the extras the pipeline and the tests need (pyproject.toml). --no-index: every dependency
# must already be installed from requirements.lock (nothing is downloaded here; a range the lock does not
# satisfy stops the set-up). The [bench] extra (llama.cpp) stays optional: requirements-bench.txt.
.venv/bin/pip install --quiet --disable-pip-version-check --no-index --no-build-isolation -e ".[pipeline,eval,dev]"
.venv/bin/python native/build.py   # the S3D8 kernel library: pipeline/_s3d8_native*.so
# The default DVC remote for `dvc push` / `dvc pull` is a local directory (.dvc/config:
# ~/.cache/s3d8-pipeline/dvc-remote, shared by every clone of this user on this machine). Create it, or
# whichever local directory .dvc/config.local makes the default (`dvc remote modify --local local url DIR`).
.venv/bin/python - <<'DVC_REMOTE'
import os, re
from dvc.config import Config
conf = Config(dvc_dir=".dvc")
name = conf["core"].get("remote")
url = conf["remote"].get(name, {}).get("url", "") if name else ""
if url.startswith("file://"):
    url = url[len("file://"):]
if url and not re.match(r"\w+://", url):
    os.makedirs(url, exist_ok=True)
    print(f"DVC remote '{name}': {url}")
DVC_REMOTE
