"""The S3D8 packed layout (SPEC sections 1 and 7), declared once. Everything that writes, reads or checks S3D8
bytes takes it from here: the format (``pipeline.formats.s3d8``), the native kernels' bindings, the runtime, the
.sqt export, the synthetic models and the benchmarks. It imports nothing of the project, so any module can."""

from __future__ import annotations

NAME = "llama-mobile-s3d8-packed-v1"   # the layout string: packed files' ``llama_mobile_format`` metadata
GROUP = 3                # weights per byte: three consecutive output channels at one input index
COLUMN_ALIGN = 16        # bytes per group row: d_in padded to a multiple of this
N_CENTROIDS = 32         # entries of a matrix's table (a 5-bit index)
TABLE_SHAPE = (N_CENTROIDS, GROUP)   # int8 magnitudes in [0, 127]


def packed_shape(d_out: int, d_in: int) -> tuple[int, int]:
    """``(rows, columns)`` of a ``[d_out, d_in]`` weight's packed bytes: ``ceil(d_out / 3)`` groups of output
    channels, each ``d_in`` padded to a multiple of 16."""
    return -(-d_out // GROUP), -(-d_in // COLUMN_ALIGN) * COLUMN_ALIGN
