"""The arm-bench stage end to end on tiny shapes: records, report and chart are written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest


def load_stage():
    spec = importlib.util.spec_from_file_location("arm_bench", Path(__file__).parents[1] / "stages" / "arm_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_arm_bench_writes_records_report_and_chart(tmp_path):
    stage = load_stage()
    params = stage.BenchParams(shapes=["1x64x30", "20x40x9"], threads=[1], repeats=2, budget_s=0.5, rotate_mb=1)
    stage.run(params, tmp_path / "bench.json")
    result = json.loads((tmp_path / "bench.json").read_text())
    records = result["records"]
    keys = {"op", "m", "k", "n", "format", "impl", "variant", "threads", "gmacs", "weight_gbps"}
    assert all(keys <= set(r) for r in records)
    impls = {(r["m"], r["format"], r["impl"]) for r in records}
    assert (1, "s3d8", "library") in impls and (1, "read", "memory read (bandwidth probe)") in impls
    assert (20, "s3d8", "library path=tiled") in impls and (20, "s3d8", "library decode only") in impls
    assert {r["variant"] for r in records if r["impl"] == "library"} == {result["machine"]["variant"]}
    assert "m20_k40_n9_s3d8_over_best_int8_1t" in result["summary"]
    report = (tmp_path / "bench.md").read_text()
    assert "## Targets" in report and "Pixel 8a" in report
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_arm_bench_rejects_bad_shapes():
    stage = load_stage()
    with pytest.raises(ValueError, match="MxKxN"):
        stage.parse_shape("4096x14336")
