"""Static checks of the PR workflow (.github/workflows/pipeline.yml): it parses, installs CPU torch into
the venv that setup.sh then uses, caches the venv and the DVC cache, runs .ci/run, reproduces the
pipeline, and comments only where the token can write (not on pull requests from forks)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "pipeline.yml"
TORCH_PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
FORK_GUARD = "github.event.pull_request.head.repo.full_name == github.repository"
CURRENT = {"actions/checkout": "v4", "actions/setup-python": "v5", "actions/cache": "v4",
           "iterative/setup-cml": "v2"}


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


@pytest.fixture(scope="module")
def steps(workflow) -> list[dict]:
    (job,) = workflow["jobs"].values()
    return job["steps"]


def index_of(steps: list[dict], pred) -> int:
    found = [i for i, s in enumerate(steps) if pred(s)]
    assert found, "no such step"
    return found[0]


def runs(step: dict, pattern: str) -> bool:
    return re.search(pattern, step.get("run", ""), re.M) is not None


def uses(step: dict, action: str) -> bool:
    return step.get("uses", "").split("@")[0] == action


def test_parses_with_triggers_and_permissions(workflow):
    on = workflow.get("on", workflow.get(True))      # YAML 1.1 reads a bare `on` key as True
    assert "pull_request" in on
    assert workflow["permissions"]["pull-requests"] == "write"      # for the comment
    assert workflow["permissions"]["contents"] == "read"
    (job,) = workflow["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest" and job["timeout-minutes"] <= 360


def test_current_action_versions(steps):
    used = [s["uses"] for s in steps if "uses" in s]
    for ref in used:
        action, _, version = ref.partition("@")
        assert action in CURRENT, f"unexpected action {ref}"
        assert version == CURRENT[action], f"{ref}: expected @{CURRENT[action]}"
    assert {"actions/checkout", "actions/setup-python", "actions/cache"} <= {u.split("@")[0] for u in used}


def test_checkout_has_history_for_metrics_diff(steps):
    checkout = steps[index_of(steps, lambda s: uses(s, "actions/checkout"))]
    assert checkout.get("with", {}).get("fetch-depth") == 0


def test_cpu_torch_goes_into_the_venv_that_setup_sh_uses(steps):
    setup = index_of(steps, lambda s: runs(s, r"^\s*(\./|bash )?setup\.sh\b"))
    torch = index_of(steps, lambda s: runs(s, re.escape(TORCH_PIN)))
    assert torch < setup, "CPU torch must be installed before setup.sh"
    script = steps[torch]["run"]
    install = next(line for line in script.splitlines() if TORCH_PIN in line)
    argv = shlex.split(install)
    assert argv[0] in (".venv/bin/pip", ".venv/bin/python"), f"torch is not installed into .venv: {install}"
    assert TORCH_PIN in argv
    assert argv[argv.index("--index-url") + 1] == CPU_INDEX
    # The venv is created before, with the interpreter setup-python provides.
    before = script[: script.index(install)]
    assert re.search(r"python3? -m venv \.venv\b", before), "the venv is not created before the torch install"
    # setup.sh keeps that venv (it creates one only when .venv/bin/python is missing) and installs into it.
    text = (ROOT / "setup.sh").read_text()
    assert re.search(r"if \[ ! -x \.venv/bin/python \]; then\n\s*python3 -m venv \.venv", text)
    assert ".venv/bin/pip install --quiet --disable-pip-version-check -r requirements.lock" in text
    # requirements.lock's exact pin is what the CPU wheel (2.13.0+cpu) satisfies.
    assert TORCH_PIN in (ROOT / "requirements.lock").read_text().splitlines()
    # Skipped exactly when the cached venv is restored.
    cache_id = steps[index_of(steps, lambda s: uses(s, "actions/cache") and s["with"]["path"] == ".venv")]["id"]
    assert steps[torch]["if"].replace(" ", "") == f"steps.{cache_id}.outputs.cache-hit!='true'"
    # And set-up checks that the CPU build is what ended up there.
    assert "2.13.0+cpu" in steps[setup]["run"]


def test_venv_cache_is_keyed_on_its_inputs(steps):
    i = index_of(steps, lambda s: uses(s, "actions/cache") and s["with"]["path"] == ".venv")
    key = steps[i]["with"]["key"]
    for name in ("requirements.lock", "pyproject.toml", "setup.sh"):
        assert f"'{name}'" in key, f"venv cache key does not hash {name}"
    assert "steps.python.outputs.python-version" in key             # the venv links to the interpreter
    python = index_of(steps, lambda s: uses(s, "actions/setup-python"))
    assert steps[python]["id"] == "python" and python < i
    assert i < index_of(steps, lambda s: runs(s, re.escape(TORCH_PIN)))


def test_dvc_cache_is_restored_before_reproduce(steps):
    i = index_of(steps, lambda s: uses(s, "actions/cache") and s["with"]["path"] == ".dvc/cache")
    key = steps[i]["with"]["key"]
    for name in ("dvc.lock", "params.yaml"):
        assert f"'{name}'" in key
    assert steps[i]["with"].get("restore-keys"), "no fallback to an older DVC cache"
    assert i < index_of(steps, lambda s: runs(s, r"\bdvc repro\b"))


def test_ci_run_and_reproduce(steps):
    ci = index_of(steps, lambda s: runs(s, r"^\s*(bash )?\.ci/run\s*$"))
    assert steps[ci].get("env", {}).get("S3D8_REQUIRE_CROSS") == "1"      # NEON tests must not skip
    cross = index_of(steps, lambda s: runs(s, r"qemu-user-static") and runs(s, r"gcc-aarch64-linux-gnu"))
    assert cross < ci
    setup = index_of(steps, lambda s: runs(s, r"^\s*(\./|bash )?setup\.sh\b"))
    repro = index_of(steps, lambda s: runs(s, r"\bdvc repro\b"))
    assert setup < ci < repro
    assert (ROOT / ".ci" / "run").exists()


def test_comment_only_where_the_token_can_write(steps):
    comment = index_of(steps, lambda s: runs(s, r"\bcml comment\b"))
    cml = index_of(steps, lambda s: uses(s, "iterative/setup-cml"))
    assert cml < comment
    for i in (cml, comment):
        cond = steps[i].get("if", "")
        assert FORK_GUARD in cond, f"step {steps[i].get('name', steps[i].get('uses'))} lacks the fork guard"
        assert "github.event_name == 'pull_request'" in cond
    assert steps[comment]["env"]["REPO_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}"
    # The report itself is built unconditionally (job summary), after the reproduction.
    report = index_of(steps, lambda s: runs(s, r"dvc metrics diff"))
    assert "if" not in steps[report]
    assert index_of(steps, lambda s: runs(s, r"\bdvc repro\b")) < report < comment
    assert runs(steps[report], r"GITHUB_STEP_SUMMARY")


def test_no_untrusted_expressions_in_scripts(steps):
    # Values from the event go through env:, never straight into a shell script.
    for step in steps:
        assert "${{" not in step.get("run", ""), f"expression inside run: of {step.get('name')}"
