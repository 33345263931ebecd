"""The kernel benchmark library (pipeline.bench) on tiny shapes: records, metrics, report and chart."""

from __future__ import annotations

import pytest

from pipeline import native
from pipeline.bench import BenchParams
from pipeline.params import defaults
from pipeline.bench.kernels import check_params, metrics, parse_shape, run
from pipeline.bench.kernels_report import chart, markdown


def test_records_metrics_report_and_chart(tmp_path):
    p = defaults(BenchParams, "bench", shapes=["1x64x30", "20x40x9"], threads=[1], repeats=2, budget_s=0.2,
                 rotate_mb=1)
    records, machine = run(p, log=lambda line: None)
    keys = {(r["m"], r["key"]) for r in records}
    assert (1, "s3d8") in keys and (1, "read") in keys and (1, "bf16") in keys
    assert (20, "s3d8_tiled") in keys and (20, "s3d8_decode") in keys and (20, "int8_int_mm") in keys
    assert {r["timing"] for r in records if r["m"] == 1} == {"sweep"}      # generate shapes stream like a decode
    assert {r["timing"] for r in records if r["m"] == 20} == {"call"}
    assert {r["variant"] for r in records if r["impl"] == "library"} == {machine["variant"]}
    result = metrics(records)
    assert "m20_k40_n9_s3d8_over_best_int8_1t" in result["summary"]
    assert result["gmacs"]["1x64x30"]["1t"].keys() >= {"s3d8", "int8", "int8_int_mm", "int8_fbgemm", "bf16"}
    report = markdown(records, result["summary"], machine, p)
    assert "## Targets" in report and "Pixel 8a" in report
    chart(records, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_params_are_checked():
    with pytest.raises(ValueError, match="MxKxN"):
        parse_shape("4096x14336")
    with pytest.raises(ValueError, match="bench.variant") as e:
        check_params(defaults(BenchParams, "bench", variant="nope"))
    assert all(v in str(e.value) for v in native.available_variants())
    with pytest.raises(ValueError, match="bench.threads"):
        check_params(defaults(BenchParams, "bench", threads=[0]))
    assert check_params(defaults(BenchParams, "bench", shapes=["1x2x3"])) == [(1, 2, 3)]
