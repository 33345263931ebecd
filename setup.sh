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
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
.venv/bin/python native/build.py   # the S3D8 kernel library: pipeline/_s3d8_native*.so
