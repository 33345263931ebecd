"""pipeline/bench/quant_sensitivity.py on the committed teacher, a few items: rows, error scaling, k = 0 is the teacher."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sensitivity_rows(tmp_path):
    out = tmp_path / "sens.json"
    subprocess.run([sys.executable, "-m", "pipeline.bench.quant_sensitivity", "--formats", "int", "lloyd_max",
                    "--scales", "0", "1", "2", "--n", "4", "--out", str(out)], cwd=ROOT, check=True,
                   capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["k"]) for r in rows] == [(f, k) for f in ("int", "lloyd_max") for k in (0.0, 1.0, 2.0)]
    by = {(r["format"], r["k"]): r for r in rows}
    for f in ("int", "lloyd_max"):
        assert by[f, 0.0]["rel_rmse"] == 0 and 0.1 < by[f, 1.0]["rel_rmse"] < 0.5
        assert abs(by[f, 2.0]["rel_rmse"] - 2 * by[f, 1.0]["rel_rmse"]) < 1e-9
    # k = 0 restores the teacher's own weights whatever the format before it did
    assert by["int", 0.0]["scores"] == by["lloyd_max", 0.0]["scores"]
