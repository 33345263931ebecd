"""One CPU code path for the pipeline's stages, so that they write the same bytes on any x86-64 CPU with AVX2:
Intel or AMD, with or without AVX-512, AVX-512 BF16 or AMX.

torch picks its CPU kernels from the CPU it runs on, and three of its libraries sum in an order that follows the
pick: ATen's vectorised kernels (softmax, norms, attention; 8 or 16 float lanes, ``ATEN_CPU_CAPABILITY``), MKL's
GEMM and LAPACK (one code path per ISA and vendor) and oneDNN's bf16 and convolution kernels (AMX, AVX-512 BF16,
or none at all without AVX-512). A last-bit difference is not harmless downstream: it flips a sampled token of
the bf16 teacher, a fake-quant code in QAT or an INT8 activation rounding, and the run diverges from there
(measured on the CI preset with the AVX2 paths forced on an AVX-512 Xeon: calibrate's sums, every file of the
GPTQ cast, QAT's weights and eval's KL differed, each with the previous stage's outputs held fixed).

Importing this module first in a stage script, before torch computes anything, pins all three:

- ATen runs its AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``; every CPU the project supports has them);
- MKL runs in conditional numerical reproducibility mode on its ``COMPATIBLE`` branch (``MKL_CBWR``), the one
  MKL documents as giving the same results on Intel and non-Intel CPUs (at a fixed thread count);
- oneDNN is switched off (``torch.backends.mkldnn.enabled = False``), so bf16 products and convolutions take
  ATen's own kernels, as on a CPU without AVX-512 BF16.

The native S3D8 kernels need no pin: every variant equals the scalar reference bit for bit. The price is speed
where the CPU has more than AVX2 (the toy's stages are overhead-bound; a real teacher's bf16 products lose AMX).
``cpu_numerics: native`` in ``params.yaml`` (every stage lists it, so DVC re-runs them when it changes) leaves torch's
choices alone: faster, and results that depend on the CPU. The environment variable ``S3D8_CPU_NUMERICS``
(``portable`` or ``native``) overrides the file for one process outside DVC (``s3d8 pack``, a benchmark); DVC does
not see it. Other architectures are left alone too (their kernels are not pinned), and so are GPUs.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from pipeline.params import check_cpu_numerics as check_mode
from pipeline.section import load_yaml

PINNED_CAPABILITY = "AVX2"
OPT_OUT = "S3D8_CPU_NUMERICS"
PARAM = "cpu_numerics"


def mode(params: str | Path = "params.yaml") -> str:
    """``portable`` or ``native``: ``S3D8_CPU_NUMERICS`` where it is set, else ``params``' top-level ``cpu_numerics``
    (the working directory's ``params.yaml``: a stage's), else portable."""
    if OPT_OUT in os.environ:
        try:
            return check_mode(os.environ[OPT_OUT])
        except ValueError as e:
            raise ValueError(f"environment variable {OPT_OUT}: {e}") from None
    doc = load_yaml(Path(params)) if Path(params).is_file() else None
    if not isinstance(doc, dict) or PARAM not in doc:
        return "portable"
    try:
        return check_mode(doc[PARAM])
    except ValueError as e:
        raise ValueError(f"{params}: parameter {PARAM}: {e}") from None


def pinned() -> bool:
    """Whether this process pins the CPU code path (x86-64, portable numerics)."""
    return platform.machine().lower() in ("x86_64", "amd64") and mode() == "portable"


def pin() -> None:
    """Pin ATen, MKL and oneDNN to one code path; an error if torch already chose its kernels."""
    if not pinned():
        return
    os.environ["ATEN_CPU_CAPABILITY"] = PINNED_CAPABILITY.lower()   # read at torch's first dispatch
    os.environ["MKL_CBWR"] = "COMPATIBLE"                            # read at MKL's first call
    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != PINNED_CAPABILITY:
        raise RuntimeError(f"torch runs its {capability} kernels, not {PINNED_CAPABILITY}: either torch computed "
                           f"before pipeline.cpu_numerics was imported (import it first) or this CPU lacks AVX2 "
                           f"({PARAM}: native runs without the pin)")


def describe() -> dict:
    """The code path this process runs, for run logs."""
    return {"mode": mode(), "pinned": pinned(), "aten": torch.backends.cpu.get_cpu_capability(),
            "mkldnn": torch.backends.mkldnn.enabled, "mkl_cbwr": os.environ.get("MKL_CBWR")}


pin()
