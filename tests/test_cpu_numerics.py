"""The pin of torch's CPU code path (pipeline/cpu_numerics.py): the variables that force another CPU's code path
really change torch's kernels without it, and change nothing with it. The stages' own bytes under both code paths:
tests/test_stages.py::test_every_stage_writes_the_same_bytes_on_an_avx2_cpus_code_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline import native

# What an AVX2-only x86 CPU (an AMD Zen 3, say) runs, forced on this one: torch's ATen kernels, MKL and oneDNN at
# AVX2 (ATEN_CPU_CAPABILITY alone fails in bf16 attention, whose oneDNN kernels still see the AVX-512 CPU), and
# the native kernels' avx2 variant.
AVX2_CPU = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "S3D8_VARIANT": "avx2"}

def _own_capability() -> str:
    """The code path torch picks on this CPU left alone (this test process itself is pinned: tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k not in AVX2_CPU and k != "MKL_CBWR"}
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()


OWN_CAPABILITY = _own_capability()

INTEL = "GenuineIntel" in open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else False

needs_avx512 = pytest.mark.skipif(
    OWN_CAPABILITY != "AVX512" or "avx512" not in native.available_variants(),
    reason="this CPU's own code path is the AVX2 one: nothing to compare it with")

PROBE = """
import hashlib, json, sys
if sys.argv[1] == "pinned":
    import pipeline.cpu_numerics
import torch
from pipeline import native
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
a, b = torch.randn(160, 256, generator=g), torch.randn(256, 128, generator=g)
q = torch.randn(1, 4, 40, 32, generator=g).bfloat16()
results = {
    "fp32 matmul (MKL)": a @ b,
    "cholesky (MKL)": torch.linalg.cholesky(a.T @ a + torch.eye(256)),
    "softmax (ATen)": torch.softmax(a, -1),
    "bf16 linear (oneDNN)": torch.nn.functional.linear(a.bfloat16(), b.T.bfloat16()),
    "bf16 attention": torch.nn.functional.scaled_dot_product_attention(q, q, q),
}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "variant": native.variant(),
                  "hashes": {k: hashlib.sha256(v.float().numpy().tobytes()).hexdigest() for k, v in results.items()}}))
"""


def _probe(mode: str, env: dict) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in AVX2_CPU and k not in ("S3D8_CPU_NUMERICS", "MKL_CBWR")}
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], env=base | env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


@needs_avx512
def test_the_forced_avx2_code_path_changes_torchs_results_without_the_pin():
    own = _probe("native", {"S3D8_CPU_NUMERICS": "native"})
    avx2 = _probe("native", {"S3D8_CPU_NUMERICS": "native"} | AVX2_CPU)
    assert (own["capability"], own["variant"]) == ("AVX512", "avx512")
    assert (avx2["capability"], avx2["variant"]) == ("AVX2", "avx2")
    differ = [k for k in own["hashes"] if own["hashes"][k] != avx2["hashes"][k]]
    expected = {"softmax (ATen)", "bf16 linear (oneDNN)"}
    if INTEL:   # MKL runs its AVX2 kernels on an AMD CPU whatever it offers: nothing for the pin to change there
        expected |= {"fp32 matmul (MKL)", "cholesky (MKL)"}
    assert expected <= set(differ), differ


@needs_avx512
def test_the_pin_gives_one_code_path_whatever_the_cpu_offers():
    own = _probe("pinned", {})
    avx2 = _probe("pinned", AVX2_CPU)
    assert own["capability"] == avx2["capability"] == "AVX2"
    assert own["hashes"] == avx2["hashes"]


def test_the_pin_refuses_to_run_after_torch_chose_its_kernels():
    script = ("import torch; torch.ones(3).sum(); import os; os.environ.pop('S3D8_CPU_NUMERICS', None); "
              "import pipeline.cpu_numerics")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"})
    if OWN_CAPABILITY == "AVX2":
        assert proc.returncode == 0, proc.stderr          # the CPU's own path is the pinned one: nothing to refuse
    else:
        assert proc.returncode != 0 and "import it first" in proc.stderr, proc.stderr


def test_opting_out_leaves_torch_alone():
    proc = subprocess.run([sys.executable, "-c", "import pipeline.cpu_numerics as c, json; print(json.dumps(c.describe()))"],
                          env={**os.environ, "S3D8_CPU_NUMERICS": "native"}, capture_output=True, text=True, check=True)
    described = json.loads(proc.stdout)
    assert described["pinned"] is False and described["mkldnn"] is True


def test_every_stage_but_the_cpu_dependent_ones_pins_first():
    """The pin is the first import of every stage script (arm-bench measures this CPU; toy-teacher keeps its
    committed weights as the reference, README "The same bytes on any x86-64 CPU")."""
    from pathlib import Path
    unpinned = {"arm_bench.py", "toy_teacher.py", "__init__.py"}
    for script in sorted((Path(__file__).resolve().parents[1] / "stages").glob("*.py")):
        imports = [line for line in script.read_text().splitlines()
                   if line.startswith(("import ", "from ")) and not line.startswith("from __future__")]
        project = [line for line in imports if not line.split()[1].split(".")[0] in sys.stdlib_module_names]
        pins = bool(project) and project[0].startswith("import pipeline.cpu_numerics")
        assert pins == (script.name not in unpinned), script.name


def test_the_mode_is_a_parameter_dvc_tracks_and_the_environment_overrides_it(tmp_path, monkeypatch):
    """params.yaml's ``cpu_numerics`` (every pinned stage lists it in dvc.yaml) chooses the code path; the
    environment variable overrides it for one process; anything but portable / native is an error naming it."""
    import yaml

    from pipeline import cpu_numerics, params

    monkeypatch.delenv(cpu_numerics.OPT_OUT, raising=False)
    path = tmp_path / "params.yaml"
    assert cpu_numerics.mode(path) == "portable"                         # no file: portable
    path.write_text("cpu_numerics: native\n")
    assert cpu_numerics.mode(path) == "native"
    monkeypatch.setenv(cpu_numerics.OPT_OUT, "portable")
    assert cpu_numerics.mode(path) == "portable"
    monkeypatch.setenv(cpu_numerics.OPT_OUT, "fast")
    with pytest.raises(ValueError, match="S3D8_CPU_NUMERICS: expected portable or native, got 'fast'"):
        cpu_numerics.mode(path)
    monkeypatch.delenv(cpu_numerics.OPT_OUT)
    path.write_text("cpu_numerics: avx2\n")
    with pytest.raises(ValueError, match="parameter cpu_numerics: expected portable or native"):
        cpu_numerics.mode(path)
    with pytest.raises(params.ParamsError, match="cpu_numerics"):
        params.validate({**params.load_yaml("params.yaml"), "cpu_numerics": "avx2"})
    stages = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "dvc.yaml")))["stages"]
    unpinned = {"toy-teacher", "arm-bench"}
    for name, stage in stages.items():
        body = stage.get("do", stage)
        assert ("cpu_numerics" in body.get("params", [])) == (name not in unpinned), name
