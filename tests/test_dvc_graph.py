"""dvc.yaml is the code's dependency graph: every project file a stage's script imports (transitively) is a dep
of that stage, every param it lists exists, and none is a thread count (threads do not change a result)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipeline import params
from pipeline.depgraph import PARAMS_ONLY, command_imports

ROOT = Path(__file__).resolve().parent.parent
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())
STAGES = DVC["stages"]


def _script(stage: dict) -> str:
    return re.search(r"stages/\w+\.py", stage["cmd"]).group(0)


def _covered(path: str, deps: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


@pytest.mark.parametrize("name", sorted(STAGES))
def test_stage_lists_every_module_it_imports(name):
    stage = STAGES[name]
    deps = [str(d) for d in stage["deps"]]
    if name in PARAMS_ONLY:               # the CPU-dependent toy teacher: re-run by its parameters alone
        assert not [d for d in deps if d.startswith(("pipeline", "stages", "native"))], deps
        return
    missing = [f for f in command_imports(stage["cmd"]) if not _covered(f, deps)]
    assert not missing, f"dvc.yaml stage {name!r} does not list {missing} (python -m pipeline.depgraph --update dvc.yaml)"
    for dep in deps:
        if "${" not in dep and dep.startswith(("pipeline", "stages", "native")):
            assert (ROOT / dep).exists(), f"stage {name!r} lists {dep}, which does not exist"


@pytest.mark.parametrize("name", sorted(STAGES))
def test_stage_params_exist_and_leave_out_threads(name):
    doc = params.load_yaml(ROOT / "params.yaml")
    for key in STAGES[name].get("params", []):
        node = doc
        for part in str(key).split("."):
            assert isinstance(node, dict) and part in node, f"stage {name!r} lists param {key!r}, not in params.yaml"
            node = node[part]
        if key == "bench.threads":           # the thread counts the benchmark measures: a result dimension
            continue
        if key == "qat.threads":             # QAT's reduction order, so its bytes, depend on it: a re-run when it changes
            continue
        assert not str(key).endswith("threads"), f"stage {name!r} depends on {key!r}, which changes no result"


def test_no_stage_depends_on_a_whole_section_it_reads_only_part_of():
    """Whole sections only where the stage reads every key (threads excluded) of it."""
    doc = params.load_yaml(ROOT / "params.yaml")
    for name, stage in STAGES.items():
        for key in stage.get("params", []):
            value = doc
            for part in str(key).split("."):
                value = value[part]
            if isinstance(value, dict) and "threads" in value and key != "bench":
                pytest.fail(f"stage {name!r} depends on the whole section {key!r}, thread count included")


def test_metrics_hold_results_only():
    """No provenance in a metrics file: commits, versions, fingerprints, timings, echoed params."""
    noise = re.compile(r"git_commit|fingerprint|seconds|load_average|\"params\"|\"versions\"|\"torch\"")
    for stage in STAGES.values():
        for entry in stage.get("metrics", []):
            path = next(iter(entry)) if isinstance(entry, dict) else entry
            formats = params.load_yaml(ROOT / "params.yaml")["formats"]
            for concrete in {ROOT / str(path).replace("${item.format}", f) for f in formats}:
                assert not noise.search(concrete.read_text()), f"{concrete.relative_to(ROOT)} holds provenance"
