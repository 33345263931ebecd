"""The arm-bench stage as a user runs it: --help, a tiny shape end to end (metrics are numbers only), and
--generate on the toy (the tokens/s records, issue 15 item 4)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
STAGE = REPO / "stages" / "arm_bench.py"


def run_stage(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STAGE), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def leaves(obj, path=""):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, f"{path}.{key}" if path else key)
    else:
        yield path, obj


def test_help_prints_usage_and_runs_nothing(tmp_path):
    result = run_stage("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--shapes" in result.stdout and "--threads" in result.stdout and "--out" in result.stdout
    assert "--generate" in result.stdout and "--models" in result.stdout
    assert not any(tmp_path.iterdir())


def test_tiny_shape_writes_numeric_metrics_and_provenance(tmp_path):
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    doc["bench"].update(repeats=2, budget_s=0.2, rotate_mb=1)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    result = run_stage("--params", str(tmp_path / "params.yaml"), "--shapes", "1x64x96,20x40x9", "--threads", "1",
                       "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    metrics = json.loads((out / "bench.json").read_text())
    assert set(metrics) == {"summary", "gmacs", "s3d8_over_int8", "bandwidth_gbps"}
    values = dict(leaves(metrics))
    bad = {k: v for k, v in values.items() if isinstance(v, bool) or not isinstance(v, (int, float))}
    assert not bad, f"non-numeric metrics: {bad}"
    assert values["gmacs.1x64x96.1t.s3d8"] > 0 and values["gmacs.1x64x96.1t.int8"] > 0
    assert values["s3d8_over_int8.1x64x96.1t.library"] > 0
    assert values["bandwidth_gbps.1x64x96.1t.read"] > 0
    assert "gmacs.20x40x9.1t.s3d8_tiled" in values and "bandwidth_gbps.20x40x9.1t.s3d8_decode" in values
    assert "summary.m20_k40_n9_s3d8_over_best_int8_1t" in values
    assert not any(word in key for key in values for word in ("commit", "version", "load", "ms", "variant"))

    machine = json.loads((out / "bench_machine.json").read_text())
    assert machine["params"]["shapes"] == ["1x64x96", "20x40x9"] and machine["params"]["rotate_mb"] == 1
    assert machine["machine"]["variant"] in machine["machine"]["variants"]
    assert {"load_average_start", "load_average_end", "omp_wait_policy"} <= set(machine["machine"])
    assert machine["torch"] and machine["pipeline"]
    report = (out / "bench.md").read_text()
    assert "## Targets" in report and "Pixel 8a" in report and machine["machine"]["variant"] in report
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"



GENERATE_KEYS = {"model", "format", "impl", "threads", "prompt_tokens", "new_tokens", "prefill_tokens_per_s",
                 "decode_tokens_per_s", "weight_bytes", "peak_rss_mb"}


def test_generate_writes_only_the_records(tmp_path):
    """The issue 15 item 4 command on the smallest model (the toy: S3D8 and INT8, lean and hf loops), about 25 s."""
    result = run_stage("--generate", "--models", "toy", "--threads", "1", "--out", "tmp/x.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    doc = json.loads((tmp_path / "tmp" / "x.json").read_text())
    assert set(doc) == {"records"}
    records = doc["records"]
    assert {(r["model"], r["format"], r["impl"], r["threads"]) for r in records} == {
        ("toy", "s3d8", "lean", 1), ("toy", "s3d8", "hf", 1), ("toy", "int8", "lean", 1), ("toy", "int8", "hf", 1)}
    for r in records:
        assert set(r) == GENERATE_KEYS
        numbers = {k: v for k, v in r.items() if k not in ("model", "format", "impl")}
        bad = {k: v for k, v in numbers.items() if isinstance(v, bool) or not isinstance(v, (int, float))}
        assert not bad, f"non-numeric record values: {bad}"
        assert r["prompt_tokens"] == 128 and r["new_tokens"] == 64
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["weight_bytes"] > 0 and r["peak_rss_mb"] > 0
    assert not (tmp_path / "reports").exists()          # the kernel table is not run


def test_generate_options_need_generate(tmp_path):
    result = run_stage("--models", "toy", "--out", "x.json", cwd=tmp_path)
    assert result.returncode == 2 and "--models needs --generate" in result.stderr
    result = run_stage("--generate", "--shapes", "1x64x96", "--out", "x.json", cwd=tmp_path)
    assert result.returncode == 2 and "--shapes does not apply with --generate" in result.stderr
    assert not any(tmp_path.iterdir())


def test_generate_benchmark_writes_its_report_atomically(tmp_path, monkeypatch):
    """``python -m pipeline.bench.generate`` on the toy (a short prompt): JSON, markdown and plot, nothing else; the
    toy runs in every format asked for that has a packed layout."""
    from pipeline.bench import generate

    real = generate.read_bandwidth
    monkeypatch.setattr(generate, "read_bandwidth", lambda t: real(t, nbytes=1 << 26, repeats=2))
    out = tmp_path / "reports"
    assert generate.main(["--models", "toy", "--impls", "lean", "--threads", "1,2", "--prompt-tokens", "8",
                          "--new-tokens", "4", "--out", str(out)]) == 0
    data = json.loads((out / "bench_generate.json").read_text())
    assert [(r["model"], r["format"], r["impl"], r["threads"]) for r in data["records"]] == [
        ("toy", "s3d8", "lean", 1), ("toy", "s3d8", "lean", 2), ("toy", "int8", "lean", 1), ("toy", "int8", "lean", 2)]
    assert any(n.startswith("toy: no bf16 rows") for n in data["notes"])      # bf16 has no packed layout
    rec = data["records"][0]
    assert rec["new_tokens"] == 4 and 0 < rec["overhead_ms_per_token"] < 1e3 / rec["decode_tokens_per_s"]
    assert set(data["read_bandwidth_gb_s_by_threads"]) == {"1", "2"} and data["read_bandwidth_gb_s"] > 0
    assert data["machine"]["cpu"] and isinstance(data["machine"]["flags"], list)
    md = (out / "bench_generate.md").read_text()
    assert "| toy | s3d8 | lean | 1 |" in md and "fixed costs" in md and "**toy, 1 thread**" in md
    assert data["machine"]["cpu"] in md
    assert sorted(p.name for p in out.iterdir()) == ["bench_generate.json", "bench_generate.md", "bench_generate.png"]


def test_generate_benchmark_takes_a_packed_path_and_reports_huge_pages(tmp_path):
    """``--models PATH``: a packed file or directory of the user's runs as it is (no preset built, no parameter count);
    every native row says how much of the process's memory sits on transparent huge pages."""
    from pipeline.bench import generate, machine

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    assert generate.model_file(str(tmp_path), "s3d8") == tmp_path and generate.model_file(str(path), "int8") == path
    assert generate._n_params(str(tmp_path)) is None
    huge = machine.anon_huge_pages_mb()
    assert huge is None or huge >= 0


def test_generate_goals_compare_llama_cpp_at_the_same_bits():
    """The 1.3x goal is against llama.cpp's fastest type at <= 3.5 bits per weight; a type with its token
    embedding lowered (``X+embd:Y``, llama-quantize's --token-embedding-type) counts by its own file size."""
    from pipeline.bench import generate

    assert generate.llama_cpp_type("Q2_K") == ("Q2_K", None, "Q2_K")
    assert generate.llama_cpp_type("IQ3_S+embd:IQ3_S") == ("IQ3_S", "IQ3_S", "IQ3_S-embd-IQ3_S")

    def rec(fmt, impl, tps, bits):
        return {"model": "synthetic-1b", "format": fmt, "impl": impl, "threads": 1, "decode_tokens_per_s": tps,
                "bits_per_weight": bits, "weight_bytes": 4e8, "kv_cache_bytes": 0, "peak_rss_mb": 500}

    data = {"read_bandwidth_gb_s": 10.0, "threads": [1], "records": [
        rec("s3d8", "lean", 13.0, 2.68), rec("int8", "lean", 6.0, 8.0), rec("bf16", "lean", 3.0, 16.0),
        rec("Q2_K", "llama.cpp", 12.0, 3.73), rec("Q2_K+embd:Q2_K", "llama.cpp", 10.0, 3.1),
        rec("IQ3_S+embd:IQ3_S", "llama.cpp", 8.0, 3.45)]}
    [line] = generate.analyse(data)
    assert "1.30x llama.cpp's best at <= 3.5 bits (Q2_K+embd:Q2_K, 10.00 tokens/s; goal >= 1.3x: met)" in line
    data["records"] = data["records"][:4]
    [line] = generate.analyse(data)
    assert "no llama.cpp type at <= 3.5 bits/weight here; its lowest, Q2_K at 3.73 bits" in line
