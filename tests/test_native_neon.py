"""The aarch64 NEON variants, cross-compiled and run under qemu-user through the C test driver.

Needs gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user-static. Without them the tests
skip, unless S3D8_REQUIRE_CROSS=1 (set by CI), where a missing toolchain is a failure.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64-static"
INSTALL = ("apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu "
           "libc6-dev-arm64-cross qemu-user-static")
ENV = dict(os.environ, OMP_WAIT_POLICY="passive")


def require_toolchain() -> None:
    missing = [tool for tool in (CC, QEMU) if shutil.which(tool) is None]
    if not missing:
        return
    message = f"aarch64 cross toolchain missing ({', '.join(missing)}); install it with: {INSTALL}"
    if os.environ.get("S3D8_REQUIRE_CROSS") == "1":
        pytest.fail(message + " (S3D8_REQUIRE_CROSS=1: this run must test NEON)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def aarch64_program(tmp_path_factory):
    require_toolchain()
    spec = importlib.util.spec_from_file_location("s3d8_native_build",
                                                  Path(__file__).parents[1] / "native" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            out = tmp_path_factory.mktemp(f"aarch64-{name}") / name
            built[name] = build.build_program(name, cc=[CC], out=out, static=True)
        return built[name]

    return get


def run_qemu(args: list[str], cpu: str | None = None) -> subprocess.CompletedProcess:
    cmd = [QEMU] + (["-cpu", cpu] if cpu else []) + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)


def test_neon_variants_match_scalar_reference(aarch64_program):
    """qemu's default CPU ("max") has dotprod and i8mm: both NEON variants against the reference."""
    out = run_qemu([str(aarch64_program("s3d8_selftest")), "--quick"])
    assert out.returncode == 0, out.stdout + out.stderr
    for line in ("OK scalar", "OK neon", "OK neon_i8mm", "ALL OK"):
        assert line in out.stdout, out.stdout


def test_dispatch_without_i8mm(aarch64_program):
    """A dotprod-only core (Cortex-A76) runs the neon variant and reports i8mm unsupported."""
    out = run_qemu([str(aarch64_program("s3d8_selftest")), "--quick"], cpu="cortex-a76")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK neon\n" in out.stdout and "SKIP neon_i8mm" in out.stdout


def test_bench_program_under_qemu(aarch64_program):
    exe = str(aarch64_program("s3d8_bench"))
    out = run_qemu([exe, "--shapes", "1x64x48,3x40x7,20x70x9", "--rotate-mb", "1", "--repeats", "1"])
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 9 and all("check=ok" in line and "variant=neon_i8mm" in line for line in lines), out.stdout
