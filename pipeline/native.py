"""Python bindings of the S3D8 kernel library (``native/``, built by ``native/build.py``).

Tensors go to C without copies when they are CPU, strided and contiguous with the documented
dtypes. Every entry point checks its contract in Python before calling C, and wrong input is a
``ValueError`` that names the argument, never a wrong answer or a crash:

- dtype exactly as documented (no conversion of relabelled or wider types), CPU, strided layout,
  the documented number of dimensions and sizes (shapes positive);
- every byte of every tensor there (``check_readable``, before C or torch reads any): a tensor on the meta
  device, or one whose storage was freed or shrunk under it (a parameter FSDP2 has resharded keeps its shape
  over 0 bytes) would otherwise crash the process; the modules' hot path asks the same in a cheaper form;
- input tensors that are not contiguous (transposed, sliced, expanded) or carry a lazy negation
  bit are copied first; ``out=`` must be contiguous and must not overlap an input;
- S3D8 centroid tables are int8 ``[32, 3]`` in [0, 127] (decode, matmul, encode);
- products refuse ``d_in`` > ``K_MAX`` = 133,144, the largest k with ``127 * 127 * k < 2^31``: the
  int32 accumulators of every variant (and ``torch._int_mm``) would wrap beyond it. INT8 weights may
  be any int8, -128 included (exact in every variant); a weight of -128 lowers the bound to
  ``K_MAX_INT8_FULL`` = 132,104 (``128 * 127 * k < 2^31``), checked only when k exceeds it;
- ``s3d8_encode`` refuses NaN / +-Inf weights (the caller adds the tensor's name);
- ``threads`` is an int in [1, 1024], ``variant`` a name from ``available_variants()`` or None.

Non-finite values, one policy in the Python reference (``pipeline.quant``), the scalar C reference
and every SIMD variant, bit for bit (the NaN is 0x7FC00000 everywhere):

- a token (row of ``x``) with any NaN or +-Inf quantises to zeros with scale NaN, so its output
  row is all NaN (``s3d8_matmul``, ``int8_matmul``; ``quantize_activations`` gives zeros and a NaN
  scale), on every path (fused, tiled, torch);
- a weight channel scale that is NaN or +-Inf gives NaN in that output column (no ``ValueError``:
  the check costs nothing in the epilogue, where a scan of the scales would cost a pass per call);
- ``bf16_matmul`` (the float baseline) follows plain IEEE arithmetic.

Results are bit-identical to the Python reference (``pipeline.formats.s3d8``, ``pipeline.quant``)
for every variant and any thread count.

Variants: ``available_variants()`` lists those this build and CPU can run, ``variant()`` the one
used by default (the fastest, or ``S3D8_VARIANT`` from the environment). Every function takes
``variant=`` to force one.

Products (``x`` float32 ``[m, k]`` quantised per token inside, exactly as
``pipeline.quant.int8_activations``; output float32 ``[m, n]``):

- ``s3d8_matmul``: S3D8 weights. Small m: one fused decode + dot-product kernel that streams the
  packed bytes once. Larger m: the weights are decoded to INT8 a tile at a time (a tile stays in
  cache) and each tile goes to an INT8 GEMM: the variant's own kernel (VNNI; NEON ``smmla``), or
  torch's ``_int_mm`` (oneDNN, AMX where present) for many tokens on x86 (see ``_choose_path``).
- ``S3D8Linear``: an inference ``nn.Module`` over a packed weight, for running a model with these kernels.
- ``int8_matmul``: per-channel INT8 weights ``[n, k]``, same activation handling (the baseline).
- ``bf16_matmul``: bfloat16 weights, float32 arithmetic (the baseline; not bit-exact across variants).
"""

from __future__ import annotations

import operator
import os
import platform
import threading
import time

import torch

from pipeline.packed.layout import GROUP, TABLE_SHAPE, packed_shape

try:
    from pipeline._s3d8_native import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError("pipeline._s3d8_native is not built: run `.venv/bin/python native/build.py` "
                      "(./setup.sh does it)") from exc

PATHS = ("fused", "tiled", "torch")
INT8_MAX = 127
K_MAX = 133_144            # largest d_in with 127 * 127 * k < 2^31 (int32 accumulators exact)
K_MAX_INT8_FULL = 132_104  # largest d_in with 128 * 127 * k < 2^31 (an INT8 weight of -128)
MAX_THREADS = 1024
# Path choice (measured by the arm-bench stage, see reports/bench.md): the fused kernel streams the
# packed bytes once and wins while the product is memory-bound; above FUSED_MAX_M tokens the weights
# are decoded to INT8 a tile at a time. The library's own INT8 kernel beats torch's oneDNN GEMM up to
# a few hundred tokens on AVX-512 without AMX, for k up to a few thousand; beyond TORCH_MIN_M tokens
# or TORCH_MIN_K inputs (or at once where AMX exists) torch._int_mm is faster, where it has VNNI or AMX
# kernels at all (``_INT_MM_FAST``); elsewhere the library's kernels take every size.
FUSED_MAX_M = 16
TORCH_MIN_M = 512
TORCH_MIN_K = 8192
TILE_GROUPS = 32                  # tiled path: 96 channels per tile and thread (stays in L2)
TORCH_TILE_BYTES = 32 << 20       # torch path: INT8 bytes decoded per torch._int_mm call

_workspace = threading.local()


def _scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reusable buffer per thread (fresh allocations of many MiB cost page faults on every call)."""
    buf = getattr(_workspace, name, None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        with torch.inference_mode(False):     # a buffer made under inference mode cannot be written outside it
            buf = torch.empty(max(numel, 1), dtype=dtype)
        setattr(_workspace, name, buf)
    return buf[:numel]


def _scratch_address(name: str, nbytes: int) -> int:
    """The address of a reusable per-thread byte buffer of at least ``nbytes`` (``_scratch`` without the slice,
    some 3 us less on the decoding hot path)."""
    held = getattr(_workspace, name, None)
    if held is None or held[1] < nbytes:
        buf = torch.empty(max(nbytes, 1), dtype=torch.int8)
        held = (buf, buf.numel(), buf.data_ptr())
        setattr(_workspace, name, held)
    return held[2]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_X86 = platform.machine().lower() in ("x86_64", "amd64")
_FLAGS = _cpu_flags() if _X86 else set()
_AMX = "amx_int8" in _FLAGS
# torch._int_mm is fast only on oneDNN's VNNI / AMX kernels; elsewhere it takes a generic path far below the
# library's INT8 kernel (README, "Kernels"), so it is neither the default nor a tuning candidate there.
_INT_MM_FAST = bool(_FLAGS & {"avx512_vnni", "avx_vnni", "amx_int8"})


def _pad(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def available_variants() -> list[str]:
    """Variants compiled into this build that this CPU can run, slowest first."""
    return [ffi.string(lib.s3d8_variant_get(i).name).decode()
            for i in range(lib.s3d8_variant_count()) if lib.s3d8_variant_supported(i)]


def compiled_variants() -> list[str]:
    return [ffi.string(lib.s3d8_variant_get(i).name).decode() for i in range(lib.s3d8_variant_count())]


_default_cache: dict[str | None, int] = {}


def _variant_index(name: str | None) -> int:
    if name is not None and not isinstance(name, str):
        raise ValueError(f"variant: expected a variant name (str) or None, got {type(name).__name__}")
    if name is None:
        forced = os.environ.get("S3D8_VARIANT")
        if forced in _default_cache:
            return _default_cache[forced]
        index = lib.s3d8_variant_default()
        if index < 0:
            raise ValueError(f"S3D8_VARIANT={forced!r} is not available here; available: "
                             f"{available_variants()} (compiled: {compiled_variants()})")
        _default_cache[forced] = index
        return index
    index = lib.s3d8_variant_find(name.encode())
    if index < 0 or not lib.s3d8_variant_supported(index):
        raise ValueError(f"variant {name!r} is not available here; available: {available_variants()} "
                         f"(compiled: {compiled_variants()})")
    return index


def call_settings() -> tuple[int, int]:
    """``(variant index, threads)`` the kernels run with now (``S3D8_VARIANT``, torch's thread count): what a caller
    of the library's other entry points (the C decoder, :mod:`pipeline.runtime.decode_step`) passes to them."""
    return _variant_index(None), _threads(None)


def variant() -> str:
    """The variant used when none is given: ``S3D8_VARIANT`` if set, else the fastest available."""
    return ffi.string(lib.s3d8_variant_get(_variant_index(None)).name).decode()


def next_block_prefetch() -> str | None:
    """Where the x86 one-token S3D8 products prefetch their next block of packed rows, ``"l1"`` or ``"l2"``, as
    the library chose it when it loaded (``S3D8_NEXT_PREFETCH=l1|l2``, else L1 on AMD CPUs and L2 on the others:
    README, "On AMD CPUs the next block goes into L1"); None on Arm, whose kernels have no such choice."""
    forced = os.environ.get("S3D8_NEXT_PREFETCH")
    if forced not in (None, "", "l1", "l2"):
        raise ValueError(f"S3D8_NEXT_PREFETCH={forced!r}: expected l1 or l2")
    return {1: "l1", 0: "l2"}.get(lib.s3d8_next_block_to_l1())


def _threads(threads: int | None) -> int:
    if threads is None:
        return max(1, min(torch.get_num_threads(), MAX_THREADS))
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads: expected an integer in [1, {MAX_THREADS}], got {threads!r}")
    return threads


def _unreadable(t: torch.Tensor) -> str | None:
    """Why C cannot read every byte of ``t`` where it lies, or None if it can. A tensor can keep its shape over
    memory that is gone: FSDP2 resizes a resharded parameter's storage to 0 bytes, a meta tensor has none, a
    view may reach past a storage shrunk after it was made. C (and torch's own kernels) would read unmapped
    memory there and kill the process with a segmentation fault, so this is asked before any read."""
    if t.layout != torch.strided:
        return f"expected a dense (strided) tensor, got layout {t.layout}"
    if t.device.type == "meta":
        return "expected a CPU tensor, got one on the meta device (it has no data: materialise it first)"
    if t.device.type != "cpu":
        return f"expected a CPU tensor, got device {t.device}"
    if t.numel() == 0:
        return None
    reach = (t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    held = t.untyped_storage().nbytes()
    if held < reach:
        return (f"its storage holds {held} bytes but the tensor {list(t.shape)} reaches {reach}: freed or shrunk "
                "memory (e.g. a parameter FSDP2 has resharded: unshard it or pass a gathered copy)")
    return None


def check_readable(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` if C can read all of it (see ``_unreadable``), else a ``ValueError`` naming ``what``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    why = _unreadable(t)
    if why is not None:
        raise ValueError(f"{what}: {why}")
    return t


def _check(t, what: str, dtype: torch.dtype, dims: tuple[int, ...] | None = None,
           copy: bool = True) -> torch.Tensor:
    """``t`` if it is a readable CPU tensor of ``dtype`` that C can read as it is; a contiguous copy of a
    strided or lazily negated input (``copy=True``); otherwise a ``ValueError`` naming ``what``."""
    check_readable(t, what)
    if t.dtype != dtype:
        raise ValueError(f"{what}: expected dtype {dtype}, got {t.dtype}")
    if dims is not None and t.dim() not in dims:
        raise ValueError(f"{what}: expected {' or '.join(map(str, dims))} dimensions, got shape {list(t.shape)}")
    if t.is_neg():                  # a view whose values C would read without the negation
        if not copy:
            raise ValueError(f"{what}: expected a plain tensor, got a lazily negated view")
        t = t.resolve_neg()
    if not t.is_contiguous():
        if not copy:
            raise ValueError(f"{what}: expected a contiguous tensor (call .contiguous()), got strides {t.stride()}")
        t = t.contiguous()
    return t


def _ptr(t: torch.Tensor, ctype: str):
    return ffi.cast(ctype, t.data_ptr())


TABLE_RANGE = "table: centroid values must lie in [0, 127]"


def _ok(rc: int, what: str) -> None:
    """The C drivers' status: the Python checks make a failure there a bug of this module (except
    -3, a negative centroid, which the hot fused path leaves to C: 4 us less per call)."""
    if rc == -3:
        raise ValueError(f"{TABLE_RANGE}, got a negative value")
    if rc != 0:
        raise RuntimeError(f"{what}: the native library refused the call (status {rc}) after the "
                           "Python checks passed; this is a bug in pipeline/native.py")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and a0 < b0 + b.numel() * b.element_size() and \
        b0 < a0 + a.numel() * a.element_size()


def _size(value, what: str) -> int:
    """An integer size (int, numpy or 0-d integer tensor); floats and bools are refused, not truncated."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise ValueError(f"{what}: expected integer sizes, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what}: expected integer sizes, got {value!r}") from None


def _check_shape(shape, what: str = "shape") -> tuple[int, int]:
    try:
        d_out, d_in = shape
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected (d_out, d_in), got {shape!r}") from None
    d_out, d_in = _size(d_out, what), _size(d_in, what)
    if d_out < 1 or d_in < 1:
        raise ValueError(f"{what}: expected positive sizes, got {(d_out, d_in)}")
    return d_out, d_in


def _check_k(d_in: int, what: str, limit: int = K_MAX) -> None:
    if d_in > limit:
        raise ValueError(f"{what}: d_in = {d_in} exceeds {limit:,}, the largest input size whose int32 "
                         f"dot products cannot overflow ({INT8_MAX} * {INT8_MAX + (limit != K_MAX)} * k "
                         f"< 2^31); split the product along k")


def _check_table(table, values: bool = True) -> torch.Tensor:
    table = _check(table, "table", torch.int8)
    if tuple(table.shape) != TABLE_SHAPE:
        raise ValueError(f"table: expected shape [32, 3], got {list(table.shape)}")
    if values:
        _check_table_values(table)
    return table


def _check_table_values(table: torch.Tensor) -> None:
    low = int(table.min())
    if low < 0:
        raise ValueError(f"{TABLE_RANGE}, got a minimum of {low}")


def _check_s3d8(packed, table, shape, values: bool = True) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    d_out, d_in = _check_shape(shape)
    packed = _check(packed, "packed", torch.uint8, (1, 2))
    rows, cols = packed_shape(d_out, d_in)
    if packed.numel() != rows * cols or (packed.dim() == 2 and tuple(packed.shape) != (rows, cols)):
        raise ValueError(f"packed: a weight of shape ({d_out}, {d_in}) needs [{rows}, {cols}] = "
                         f"{rows * cols} bytes, got shape {list(packed.shape)}")
    return d_out, d_in, packed, _check_table(table, values)


def _check_scale(scale, d_out: int) -> torch.Tensor:
    scale = _check(scale, "scale", torch.bfloat16)
    if scale.numel() != d_out:
        raise ValueError(f"scale: expected {d_out} channel scales (bf16 [{d_out}, 1]), got shape {list(scale.shape)}")
    return scale


def _check_x(x, d_in: int) -> torch.Tensor:
    x = _check(x, "x", torch.float32)
    if x.dim() < 1 or x.shape[-1] != d_in:
        raise ValueError(f"x: expected float32 [m, {d_in}], got shape {list(x.shape)}")
    return x


def _check_out(out, what: str, dtype: torch.dtype, shape: tuple[int, ...], *inputs) -> torch.Tensor:
    out = _check(out, what, dtype, (len(shape),), copy=False)
    if tuple(out.shape) != shape:
        raise ValueError(f"{what}: expected {dtype} {list(shape)}, got shape {list(out.shape)}")
    if any(_overlap(out, t) for t in inputs):
        raise ValueError(f"{what}: must not overlap an input tensor")
    return out


def _quantize(x2: torch.Tensor, v: int, threads: int, scratch: bool = True):
    """Per-token INT8 activations in the kernels' layout: rows padded with zeros to a multiple of 64."""
    m, k = x2.shape
    stride = _pad(k, 64)
    if scratch:
        xq = _scratch("xq", m * stride, torch.int8).view(m, stride)
        xs, xsum = _scratch("xs", m, torch.float32), _scratch("xsum", m, torch.int32)
    else:
        xq = torch.empty(m, stride, dtype=torch.int8)
        xs, xsum = torch.empty(m, dtype=torch.float32), torch.empty(m, dtype=torch.int32)
    _ok(lib.s3d8_quant(v, threads, m, k, _ptr(x2, "float *"), k, _ptr(xq, "int8_t *"), stride,
                       _ptr(xs, "float *"), _ptr(xsum, "int32_t *")), "quantize")
    return xq, xs, xsum


def quantize_activations(x: torch.Tensor, variant: str | None = None,
                         threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Native ``pipeline.quant.int8_activations`` for float32 ``[m, k]``: ``(int8 [m, k], bf16 [m, 1])``.
    A row with NaN or +-Inf gives zeros and scale NaN."""
    x = _check(x, "x", torch.float32, (2,))
    if x.shape[1] < 1:
        raise ValueError(f"x: expected float32 [m, k] with k >= 1, got shape {list(x.shape)}")
    xq, xs, _ = _quantize(x, _variant_index(variant), _threads(threads), scratch=False)
    # the scales are bf16 values (or the NaN 0x7FC00000): their top 16 bits, exactly (torch's own
    # float -> bf16 conversion would turn the NaN into 0xFFFF)
    scale = (xs.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return xq[:, :x.shape[1]].contiguous(), scale.reshape(-1, 1)


def s3d8_decode_int8(packed: torch.Tensor, table: torch.Tensor, shape, variant: str | None = None,
                     threads: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode SPEC-layout S3D8 bytes to the INT8 compute format ``int8 [d_out, d_in]`` (into ``out``
    if given)."""
    d_out, d_in, packed, table = _check_s3d8(packed, table, shape)
    if out is None:
        out = torch.empty(d_out, d_in, dtype=torch.int8)
    else:
        out = _check_out(out, "out", torch.int8, (d_out, d_in), packed, table)
    _ok(lib.s3d8_decode(_variant_index(variant), _threads(threads), d_out, d_in,
                        _ptr(packed, "uint8_t *"), _ptr(table, "int8_t *"), _ptr(out, "int8_t *"), d_in),
        "s3d8_decode_int8")
    return out


def s3d8_encode(weight: torch.Tensor, table: torch.Tensor, threads: int | None = None,
                variant: str | None = None, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``weight [d_out, d_in]`` (float32, or bf16/fp16 converted exactly) like
    ``pipeline.formats.s3d8.encode``: ``(packed uint8 [ceil(d_out/3), pad16(d_in)], scale bf16 [d_out, 1])``;
    with ``scale`` (bf16 ``[d_out, 1]``, each > 0: a searched or trained scale) like ``encode_with_scale``.
    NaN or +-Inf weights are a ``ValueError`` (the message names ``weight``; callers add the tensor's name)."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise ValueError(f"weight: expected a floating-point torch.Tensor, got "
                         f"{weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if weight.dtype in (torch.bfloat16, torch.float16):
        weight = check_readable(weight, "weight").float()
    weight = _check(weight.detach(), "weight", torch.float32, (2,))
    d_out, d_in = _check_shape(weight.shape, "weight")
    # amax / amin carry a NaN or an Inf through without a full-size temporary (isfinite makes several)
    if weight.numel() and not bool(torch.isfinite(weight.amax()) & torch.isfinite(weight.amin())):
        bad = (~torch.isfinite(weight)).nonzero()
        r, c = (int(i) for i in bad[0])
        raise ValueError(f"weight: {bad.shape[0]} non-finite value(s) (NaN or +-Inf), the first "
                         f"{float(weight[r, c])} at [{r}, {c}]; S3D8 encodes finite weights only")
    table = _check_table(table)
    packed = torch.empty(packed_shape(d_out, d_in), dtype=torch.uint8)
    if scale is not None:
        if not isinstance(scale, torch.Tensor) or scale.numel() != d_out:
            raise ValueError(f"scale: expected {d_out} channel scales, got "
                             f"{list(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__}")
        scale = _check(scale.detach().reshape(d_out, 1), "scale", torch.bfloat16, (2,)).contiguous()
        if not bool((scale.float() > 0).all() & torch.isfinite(scale.float()).all()):
            raise ValueError("scale: every channel scale must be finite and > 0")
        _ok(lib.s3d8_encode_scaled(_variant_index(variant), _threads(threads), d_out, d_in, _ptr(weight, "float *"),
                                   d_in, _ptr(table, "int8_t *"), _ptr(scale, "uint16_t *"),
                                   _ptr(packed, "uint8_t *")), "s3d8_encode_scaled")
        return packed, scale
    scale = torch.empty(d_out, 1, dtype=torch.bfloat16)
    _ok(lib.s3d8_encode(_variant_index(variant), _threads(threads), d_out, d_in, _ptr(weight, "float *"),
                        d_in, _ptr(table, "int8_t *"), _ptr(packed, "uint8_t *"), _ptr(scale, "uint16_t *")),
        "s3d8_encode")
    return packed, scale


def _choose_path(path: str | None, m: int, k: int) -> str:
    if path is None:
        if m <= FUSED_MAX_M:
            return "fused"
        return "torch" if _INT_MM_FAST and (_AMX or m >= TORCH_MIN_M or k >= TORCH_MIN_K) else "tiled"
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS} or None, got {path!r}")
    return path


TUNE = os.environ.get("S3D8_TUNE_PATHS", "1") != "0"
"""Above ``FUSED_MAX_M`` tokens on a CPU with VNNI but no AMX, time the library's INT8 GEMM against torch's on the
first product of each size class and keep the faster (``S3D8_TUNE_PATHS=0``: the fixed thresholds above): the
tiled and torch paths of ``s3d8_matmul``, the fused and torch paths of ``int8_matmul``. Which INT8 GEMM wins
depends on the CPU (AMD's oneDNN kernels lose to ours at 128 tokens, Intel's win). Without VNNI there is nothing
to tune (torch's is no candidate, see ``_INT_MM_FAST``). Every path gives the same bits (tested), so tuning
changes speed only."""
_tuned: dict[tuple, str] = {}


def _tunes(path: str | None, m: int) -> bool:
    """Whether a product of ``m`` tokens with ``path`` is tuned (see ``TUNE``)."""
    return path is None and TUNE and _INT_MM_FAST and not _AMX and m > FUSED_MAX_M


def _tuned_path(key: tuple, run, candidates: tuple[str, ...] = ("tiled", "torch")) -> tuple[str, torch.Tensor]:
    """``(path, result)``: the path tuned for ``key`` and ``run(path)``'s result; the first call of a key times
    each of ``candidates`` on a second, warm call."""
    if key in _tuned:
        return _tuned[key], run(_tuned[key])
    times = {}
    for candidate in candidates:
        run(candidate)                                   # warm: workspaces, page faults, oneDNN's kernel cache
        began = time.perf_counter()
        y = run(candidate)
        times[candidate] = time.perf_counter() - began
    _tuned[key] = min(times, key=times.get)
    return _tuned[key], y


def _int_mm_epilogue(xq: torch.Tensor, w: torch.Tensor, xs: torch.Tensor, w_scale, y: torch.Tensor,
                     v: int, threads: int) -> None:
    """``y = ((float)(xq @ w.T) * xs) * w_scale`` with torch's INT8 GEMM; ``y`` may be a column slice."""
    m, n = xq.shape[0], w.shape[0]
    acc = _scratch("acc", m * n, torch.int32).view(m, n)
    # k = 1: w.t() has strides (1, 1), which torch._int_mm (oneDNN) misreads for n > 1 (wrong sums,
    # found by tests/test_native_fuzz.py); the row-major view [1, n] has unambiguous strides (n, 1).
    torch._int_mm(xq, w.t() if w.shape[1] > 1 else w.reshape(1, n), out=acc)
    _ok(lib.s3d8_dequant(v, threads, m, n, _ptr(acc, "int32_t *"), n, _ptr(xs, "float *"), w_scale,
                         _ptr(y, "float *"), y.stride(0)), "dequant")


def s3d8_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, table: torch.Tensor,
                shape, variant: str | None = None, threads: int | None = None,
                path: str | None = None) -> torch.Tensor:
    """``x @ W.T`` for an S3D8 weight ``W [d_out, d_in]``: float32 ``[m, d_in]`` -> float32 ``[m, d_out]``.

    ``y = ((float)int32_dot(int8_x, int8_w) * x_scale[m]) * w_scale[n]``. Leading dimensions of
    ``x`` beyond the last are flattened as tokens. ``path`` forces ``"fused"``, ``"tiled"`` (decode
    tiles + the variant's INT8 kernel) or ``"torch"`` (decode tiles + ``torch._int_mm``).
    A token with NaN/Inf gives an all-NaN row, a NaN/Inf channel scale a NaN column; ``d_in`` is at
    most ``K_MAX``.
    """
    d_out, d_in, packed, table = _check_s3d8(packed, table, shape, values=False)
    _check_k(d_in, "shape")
    scale = _check_scale(scale, d_out)
    x = _check_x(x, d_in)
    v, t = _variant_index(variant), _threads(threads)
    x2 = x.reshape(-1, d_in)
    m = x2.shape[0]
    if _tunes(path, m):
        key = ("s3d8", v, t, m.bit_length(), d_in.bit_length(), d_out.bit_length())
        return _tuned_path(key, lambda p: s3d8_matmul(x, packed, scale, table, shape, variant, threads, p))[1]
    y = torch.empty(m, d_out, dtype=torch.float32)
    chosen = _choose_path(path, m, d_in)
    if chosen != "fused" or m == 0:  # the fused path's C entry checks the centroids itself (-3)
        _check_table_values(table)
    if m == 0:
        return y.reshape(*x.shape[:-1], d_out)
    if chosen == "fused":
        return _fused(lib.s3d8_linear_s3d8_at, v, t, x, packed, table, scale, (d_out, d_in), "s3d8_matmul")
    xq, xs, xsum = _quantize(x2, v, t)
    p_packed, p_table, p_scale = _ptr(packed, "uint8_t *"), _ptr(table, "int8_t *"), _ptr(scale, "uint16_t *")
    if chosen == "tiled":
        work = _scratch("tiles", t * 3 * TILE_GROUPS * xq.stride(0), torch.int8)
        _ok(lib.s3d8_matmul_s3d8_tiled(v, t, m, d_out, d_in, _ptr(xq, "int8_t *"), xq.stride(0),
                                       _ptr(xs, "float *"), _ptr(xsum, "int32_t *"), p_packed, p_table,
                                       p_scale, _ptr(y, "float *"), d_out, _ptr(work, "int8_t *"),
                                       TILE_GROUPS), "s3d8_matmul")
    else:
        rows = min(_pad(d_out, GROUP), max(GROUP * TILE_GROUPS, TORCH_TILE_BYTES // d_in // GROUP * GROUP))
        tile = _scratch("decoded", rows * d_in, torch.int8).view(rows, d_in)
        k16 = packed_shape(d_out, d_in)[1]
        for r0 in range(0, d_out, rows):
            n = min(rows, d_out - r0)
            _ok(lib.s3d8_decode(v, t, n, d_in, p_packed + (r0 // GROUP) * k16, p_table,
                                _ptr(tile, "int8_t *"), d_in), "s3d8_matmul")
            _int_mm_epilogue(xq[:, :d_in], tile[:n], xs, p_scale + r0, y[:, r0:], v, t)
    return y.reshape(*x.shape[:-1], d_out)


def _qsi8_at(v, t, m, d_out, d_in, x, x_stride, weight, _table, scale, y, y_stride, work):
    return lib.s3d8_linear_qsi8_at(v, t, m, d_out, d_in, x, x_stride, weight, d_in, scale, y, y_stride, work)


def _fused(entry, v: int, t: int, x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor | None,
           scale: torch.Tensor, shape: tuple[int, int], what: str) -> torch.Tensor:
    """One C call for float32 ``x [..., d_in]`` (contiguous, checked): quantise the tokens into a reused
    workspace, then the fused product (``entry``: S3D8 bytes + table, or INT8 weights)."""
    d_out, d_in = shape
    m = x.numel() // d_in
    y = torch.empty(*x.shape[:-1], d_out, dtype=torch.float32)
    work = _scratch_address("linear", m * (_pad(d_in, 64) + 8))
    _ok(entry(v, t, m, d_out, d_in, x.data_ptr(), d_in, weight.data_ptr(), 0 if table is None else table.data_ptr(),
              scale.data_ptr(), y.data_ptr(), d_out, work), what)
    return y


def _plain_tokens(x, d_in: int) -> int:
    """The token count of ``x`` when it is what the kernels read as it is (a dense contiguous float32 CPU
    tensor ``[..., d_in]``) and the fused kernel is the default path for it, else 0: the modules' hot path for
    decoding, which skips the argument checks (tens of microseconds, x 100 products per token)."""
    if (type(x) is not torch.Tensor or x.dtype != torch.float32 or x.layout != torch.strided
            or x.dim() < 1 or x.shape[-1] != d_in or x.is_neg() or not _whole(x)):
        return 0
    m = x.numel() // d_in
    return m if _choose_path(None, m, d_in) == "fused" else 0


def _check_int8_weight(weight: torch.Tensor) -> tuple[int, int]:
    """``(d_out, d_in)`` of a checked INT8 weight: d_in at most ``K_MAX``, or ``K_MAX_INT8_FULL`` if it holds -128."""
    d_out, d_in = _check_shape(weight.shape, "weight")
    _check_k(d_in, "weight")
    if d_in > K_MAX_INT8_FULL and bool((weight == -128).any()):
        _check_k(d_in, "weight (holds -128)", K_MAX_INT8_FULL)
    return d_out, d_in


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                variant: str | None = None, threads: int | None = None,
                path: str | None = None) -> torch.Tensor:
    """``x @ W.T`` for a per-channel INT8 weight ``int8 [n, k]`` with bf16 channel scales: the same
    activation handling, non-finite policy and epilogue as ``s3d8_matmul``. Weights are symmetric INT8
    ([-127, 127]) by convention, and -128 is exact too (then k <= ``K_MAX_INT8_FULL``). ``path`` is
    ``"fused"`` (the library's kernel) or ``"torch"`` (``torch._int_mm``); by default fused for small m, and
    above ``FUSED_MAX_M`` tokens the faster of the two (tuned once per size class, see ``TUNE``)."""
    weight = _check(weight, "weight", torch.int8, (2,))
    d_out, d_in = _check_int8_weight(weight)
    scale = _check_scale(scale, d_out)
    x = _check_x(x, d_in)
    v, t = _variant_index(variant), _threads(threads)
    x2 = x.reshape(-1, d_in)
    m = x2.shape[0]
    if _tunes(path, m):
        key = ("int8", v, t, m.bit_length(), d_in.bit_length(), d_out.bit_length())
        return _tuned_path(key, lambda p: int8_matmul(x, weight, scale, variant, threads, p), ("fused", "torch"))[1]
    y = torch.empty(m, d_out, dtype=torch.float32)
    chosen = _choose_path(path, m, d_in)
    if m == 0:
        return y.reshape(*x.shape[:-1], d_out)
    if chosen == "torch":
        xq, xs, _ = _quantize(x2, v, t)
        _int_mm_epilogue(xq[:, :d_in], weight, xs, _ptr(scale, "uint16_t *"), y, v, t)
    else:  # "fused" and "tiled" are the same kernel for INT8 weights
        return _fused(_qsi8_at, v, t, x, weight, None, scale, (d_out, d_in), "int8_matmul")
    return y.reshape(*x.shape[:-1], d_out)


def bf16_matmul(x: torch.Tensor, weight: torch.Tensor, variant: str | None = None,
                threads: int | None = None) -> torch.Tensor:
    """``x @ W.T`` for a bfloat16 weight ``[n, k]`` and float32 ``x``, float32 accumulation (baseline;
    NaN and Inf propagate as in IEEE arithmetic, and the summation order is the variant's own)."""
    weight = _check(weight, "weight", torch.bfloat16, (2,))
    d_out, d_in = _check_shape(weight.shape, "weight")
    return _bf16(_variant_index(variant), _threads(threads), _check_x(x, d_in), weight)


def _bf16(v: int, t: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    d_out, d_in = weight.shape
    y = torch.empty(*x.shape[:-1], d_out, dtype=torch.float32)
    _ok(lib.s3d8_matmul_bf16(v, t, x.numel() // d_in, d_out, d_in, _ptr(x, "float *"), d_in,
                             _ptr(weight, "uint16_t *"), d_in, _ptr(y, "float *"), d_out), "bf16_matmul")
    return y


def read_bandwidth_probe(buf: torch.Tensor) -> int:
    """Read every byte of ``buf`` (uint8, contiguous) once; for measuring memory bandwidth."""
    buf = _check(buf, "buf", torch.uint8, copy=False)
    return int(lib.s3d8_read_bandwidth_probe(_ptr(buf, "uint8_t *"), buf.numel()))


def nearest_centroids(a_t: torch.Tensor, centroids: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """For each column of ``a_t`` (float32 ``[3, N]``) the first index of its nearest row of
    ``centroids`` (float32 ``[32, 3]``): int64 ``[N]``, bit for bit ``pipeline.formats.s3d8._nearest_columns``."""
    a_t = _check(a_t, "a_t", torch.float32, (2,))
    if a_t.shape[0] != 3:
        raise ValueError(f"a_t: expected [3, N] vectors as columns, got {list(a_t.shape)}")
    c = _check(centroids, "centroids", torch.float32, (2,)).contiguous()
    if tuple(c.shape) != (32, 3):
        raise ValueError(f"centroids: expected [32, 3], got {list(c.shape)}")
    out = torch.empty(a_t.shape[1], dtype=torch.int64)
    _ok(lib.s3d8_nearest_centroids(_threads(threads), a_t.shape[1], _ptr(a_t, "float *"), max(1, a_t.shape[1]),
                                   _ptr(c, "float *"), _ptr(out, "int64_t *")), "s3d8_nearest_centroids")
    return out


def _check_bias(bias, d_out: int) -> torch.Tensor | None:
    """An optional Linear bias as the native modules hold it: float32 ``[d_out]``, contiguous."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.numel() != d_out:
        raise ValueError(f"bias: expected a floating-point tensor of {d_out} values, got "
                         f"{list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
    return check_readable(bias, "bias").detach().float().reshape(d_out).contiguous()


class S3D8Linear(torch.nn.Module):
    """Inference-only linear layer over a packed S3D8 weight (float32 in, float32 out), for
    running an S3D8 model on CPU with these kernels. ``bias`` is optional (float32 [d_out])."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, shape,
                 bias: torch.Tensor | None = None):
        super().__init__()
        d_out, d_in, packed, table = _check_s3d8(packed, table, shape)
        _check_k(d_in, "shape")
        self.shape = (d_out, d_in)
        bias = _check_bias(bias, d_out)
        self.register_buffer("packed", packed.reshape(packed_shape(d_out, d_in)))
        self.register_buffer("scale", _check_scale(scale, d_out))
        self.register_buffer("table", table)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers                 # not self.packed etc.: nn.Module's attribute lookup costs ~1 us each
        if _plain_tokens(x, self.shape[1]) and _hot(b["packed"], torch.uint8, b["scale"], b["table"], b["bias"]):
            y = _fused(lib.s3d8_linear_s3d8_at, _variant_index(None), _threads(None), x, b["packed"], b["table"],
                       b["scale"], self.shape, "s3d8_matmul")
            if b["bias"] is not None:
                y += b["bias"]
            return y
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"x: expected a floating-point tensor, got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        y = s3d8_matmul(_fallback(self, x), b["packed"], b["scale"], b["table"], self.shape)
        if b["bias"] is not None:
            y += b["bias"]
        return y.to(x.dtype)

    def decoder_weight(self) -> tuple[int, tuple[int, int], torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(kind, (n, k), data, table, scale)``: this weight as the C decoder's ``s3d8_weight`` reads it."""
        b = self._buffers
        return W_S3D8, self.shape, b["packed"], b["table"], b["scale"]

    def extra_repr(self) -> str:
        return f"d_in={self.shape[1]}, d_out={self.shape[0]}, variant={variant()}"


W_S3D8, W_QSI8, W_BF16 = 0, 1, 2
"""``s3d8_weight.kind`` of the C decoder (``native/s3d8.h``): what each native module below describes itself as
(``decoder_weight``)."""


def _hot(weight: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None, *others: torch.Tensor | None) -> bool:
    """A module's buffers as construction checked them: the weight in its dtype, the scale bf16, every tensor
    still whole (``_whole``), since a storage can be freed or shrunk after construction."""
    return (weight.dtype == dtype and _whole(weight) and (scale is None or scale.dtype == torch.bfloat16)
            and all(t is None or _whole(t) for t in (scale, *others)))


def _whole(t: torch.Tensor) -> bool:
    """``_unreadable(t) is None and t.is_contiguous()`` in a fraction of the time, for the hot path."""
    return (t.is_cpu and t.is_contiguous()
            and t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size())


def _fallback(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous float32 for the checked functions, after what the hot path skipped: the module's
    buffers and ``x`` readable (``check_readable``), each named."""
    for name, t in module._buffers.items():
        if t is not None:
            check_readable(t, f"{type(module).__name__} buffer {name!r}")
    return check_readable(x, "x").float().contiguous()


class Int8Linear(torch.nn.Module):
    """Inference-only linear layer over a per-channel INT8 weight on ``int8_matmul`` (the library's INT8
    baseline), with the same hot path for decoding as :class:`S3D8Linear`."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = _check(weight, "weight", torch.int8, (2,))
        d_out, d_in = _check_int8_weight(weight)
        self.register_buffer("weight", weight)
        self.register_buffer("scale", _check_scale(scale, d_out))
        self.register_buffer("bias", _check_bias(bias, d_out))
        self.out_features, self.in_features = d_out, d_in

    @property
    def packed_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of the ``int8`` format's packed layout (what a packed file stores)."""
        return {"int8": self.weight, "scale": self.scale}

    def decoder_weight(self):
        """See :meth:`S3D8Linear.decoder_weight`."""
        b = self._buffers
        return W_QSI8, (self.out_features, self.in_features), b["weight"], None, b["scale"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        if _plain_tokens(x, self.in_features) and _hot(b["weight"], torch.int8, b["scale"], b["bias"]):
            y = _fused(_qsi8_at, _variant_index(None), _threads(None), x, b["weight"], None, b["scale"],
                       (self.out_features, self.in_features), "int8_matmul")
        else:
            y = int8_matmul(_fallback(self, x), b["weight"], b["scale"])
        if b["bias"] is not None:
            y += b["bias"]
        return y.to(x.dtype)


class Bf16Linear(torch.nn.Module):
    """Inference-only linear layer over a bf16 weight on ``bf16_matmul`` (float32 arithmetic, the float
    baseline)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        weight = _check(weight, "weight", torch.bfloat16, (2,))
        self.register_buffer("weight", weight)
        self.out_features, self.in_features = _check_shape(weight.shape, "weight")

    def decoder_weight(self):
        """See :meth:`S3D8Linear.decoder_weight`."""
        return W_BF16, (self.out_features, self.in_features), self._buffers["weight"], None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._buffers["weight"]
        if _plain_tokens(x, self.in_features) and _hot(w, torch.bfloat16, None):
            return _bf16(_variant_index(None), _threads(None), x, w)
        return bf16_matmul(_fallback(self, x), w).to(x.dtype)


# --- row embeddings: only the looked-up rows decoded ----------------------------------------------------------

class S3D8RowEmbedding(torch.nn.Module):
    """An S3D8 embedding that decodes only the looked-up rows from the packed bytes: the 3-row groups of
    the unique ids are gathered and decoded by the native kernel as one small weight, then scaled.
    Equal bit for bit to the rows of ``pipeline.formats.s3d8.decode`` (int8 value x bf16 scale in float32)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, shape,
                 padding_idx: int | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = shape
        self.register_buffer("packed", packed.reshape(packed_shape(*shape)))
        self.register_buffer("scale", scale.reshape(-1))
        self.register_buffer("table", table)
        self.padding_idx, self.dtype = padding_idx, dtype

    def decoder_weight(self):
        """See :meth:`S3D8Linear.decoder_weight`."""
        b = self._buffers
        return W_S3D8, (self.num_embeddings, self.embedding_dim), b["packed"], b["table"], b["scale"]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        for name, t in self._buffers.items():      # gathered from by torch, then decoded by C: both would crash
            check_readable(t, f"S3D8RowEmbedding buffer {name!r}")
        n, d = self.num_embeddings, self.embedding_dim
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise IndexError(f"index out of range in self: ids in [{int(ids.min())}, {int(ids.max())}], {n} embeddings")
        flat = ids.reshape(-1)
        groups, inverse = torch.unique(flat // GROUP, return_inverse=True)
        decoded = s3d8_decode_int8(self.packed[groups].contiguous(), self.table, (GROUP * groups.numel(), d))
        rows = decoded[inverse * GROUP + flat % GROUP].float() * self.scale[flat].float()[:, None]
        return rows.to(self.dtype).reshape(*ids.shape, d)


class Bf16RowEmbedding(torch.nn.Module):
    """A bf16 embedding: the looked-up rows, in ``dtype``."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    def decoder_weight(self):
        """See :meth:`S3D8Linear.decoder_weight`."""
        return W_BF16, (self.num_embeddings, self.embedding_dim), self._buffers["weight"], None, None

    def forward(self, ids):
        return self.weight[ids].to(self.dtype)


class Int8RowEmbedding(torch.nn.Module):
    """An INT8 embedding (per-row scales): the looked-up rows, int8 value x bf16 scale in float32, then ``dtype``."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.reshape(-1))
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    @property
    def packed_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of the ``int8`` format's packed layout (what a packed file stores)."""
        return {"int8": self.weight, "scale": self.scale}

    def decoder_weight(self):
        """See :meth:`S3D8Linear.decoder_weight`."""
        b = self._buffers
        return W_QSI8, (self.num_embeddings, self.embedding_dim), b["weight"], None, b["scale"]

    def forward(self, ids):
        flat = ids.reshape(-1)
        rows = self.weight[flat].float() * self.scale[flat].float()[:, None]
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)
