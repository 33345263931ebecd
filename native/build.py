"""Build the S3D8 kernel library.

    python native/build.py                      # the cffi extension pipeline/_s3d8_native*.so (set-up runs this)
    python native/build.py program s3d8_bench   # standalone program for this machine -> native/_build/<triple>/
    python native/build.py program s3d8_bench --cc aarch64-linux-gnu-gcc --static   # aarch64 Linux
    python native/build.py program s3d8_bench --cc aarch64-linux-android30-clang   # Android (NDK)
    python native/build.py program s3d8_selftest --sanitize address

Each ISA file is compiled with its own target flags and the dispatcher picks at run time, so one
build runs on any CPU of its architecture. Every file is compiled with -ffp-contract=off: the
float arithmetic of the encoder, the activation quantiser and the epilogue is part of the contract
(no fused multiply-add), so results are bit-identical across variants and with the Python reference.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

NATIVE = Path(__file__).resolve().parent
ROOT = NATIVE.parent
BUILD = NATIVE / "_build"

COMMON_FLAGS = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra",
                "-Wno-unused-parameter"]
LIBRARY = {  # source -> extra flags, per target architecture
    "x86_64": {
        "s3d8_ref.c": [],
        "s3d8_dispatch.c": ["-fopenmp"],
        "s3d8_decoder.c": ["-fopenmp"],
        "s3d8_avx2.c": ["-mavx2"],
        "s3d8_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vbmi", "-mavx512vnni"],
    },
    "aarch64": {
        "s3d8_ref.c": [],
        "s3d8_dispatch.c": ["-fopenmp"],
        "s3d8_decoder.c": ["-fopenmp"],
        "s3d8_neon.c": ["-march=armv8.2-a+dotprod"],
    },
}
PROGRAMS = ("s3d8_bench", "s3d8_selftest")

def header_structs(*names: str) -> str:
    """The ``typedef struct NAME {...} NAME;`` declarations of ``native/s3d8.h``, comments removed: the cdef's copy
    of the decoder's structs is read from the header, not written twice."""
    import re

    text = re.sub(r"/\*.*?\*/", " ", (NATIVE / "s3d8.h").read_text(), flags=re.S)
    return "\n".join(re.search(rf"typedef struct {n} \{{.*?\}} {n};", text, flags=re.S).group(0) for n in names)


CDEF = """
typedef struct s3d8_variant { const char *name; ...; } s3d8_variant;
int s3d8_variant_count(void);
const s3d8_variant *s3d8_variant_get(int i);
int s3d8_variant_supported(int i);
int s3d8_variant_find(const char *name);
int s3d8_variant_default(void);
int s3d8_next_block_to_l1(void);
int s3d8_quant(int v, int threads, size_t m, size_t k, const float *x, size_t x_stride, int8_t *xq,
               size_t xq_stride, float *x_scale, int32_t *x_sum);
int s3d8_decode(int v, int threads, size_t n, size_t k, const uint8_t *packed,
                const int8_t table[96], int8_t *w, size_t w_stride);
int s3d8_matmul_s3d8(int v, int threads, size_t m, size_t n, size_t k, const int8_t *xq,
                     size_t xq_stride, const float *x_scale, const int32_t *x_sum,
                     const uint8_t *packed, const int8_t table[96], const uint16_t *w_scale,
                     float *y, size_t y_stride);
int s3d8_matmul_qsi8(int v, int threads, size_t m, size_t n, size_t k, const int8_t *xq,
                     size_t xq_stride, const float *x_scale, const int32_t *x_sum, const int8_t *w,
                     size_t w_stride, const uint16_t *w_scale, float *y, size_t y_stride);
int s3d8_matmul_bf16(int v, int threads, size_t m, size_t n, size_t k, const float *x,
                     size_t x_stride, const uint16_t *w, size_t w_stride, float *y,
                     size_t y_stride);
int s3d8_matmul_s3d8_tiled(int v, int threads, size_t m, size_t n, size_t k, const int8_t *xq,
                           size_t xq_stride, const float *x_scale, const int32_t *x_sum,
                           const uint8_t *packed, const int8_t table[96],
                           const uint16_t *w_scale, float *y, size_t y_stride, int8_t *work,
                           size_t tile_groups);
int s3d8_encode(int v, int threads, size_t d_out, size_t d_in, const float *w, size_t w_stride,
                 const int8_t table[96], uint8_t *packed, uint16_t *scale);
int s3d8_encode_scaled(int v, int threads, size_t d_out, size_t d_in, const float *w, size_t w_stride,
                       const int8_t table[96], const uint16_t *scale, uint8_t *packed);
int s3d8_dequant(int v, int threads, size_t m, size_t n, const int32_t *acc, size_t acc_stride,
                 const float *x_scale, const uint16_t *w_scale, float *y, size_t y_stride);
uint64_t s3d8_read_bandwidth_probe(const uint8_t *buf, size_t n);
int s3d8_nearest_centroids(int threads, size_t n, const float *a, size_t stride, const float c[96],
                           int64_t *out);
""" + header_structs("s3d8_weight", "s3d8_layer", "s3d8_decoder") + """
size_t s3d8_decoder_work_bytes(const s3d8_decoder *d);
int s3d8_decoder_check(const s3d8_decoder *d, size_t *where);
int s3d8_decoder_step(int v, int threads, const s3d8_decoder *d, int64_t token, size_t pos,
                      float *logits);
size_t s3d8_decoder_batch_work_bytes(const s3d8_decoder *d, size_t count);
int s3d8_decoder_step_batch(int v, int threads, const s3d8_decoder *const *ds, size_t count,
                            const int64_t *tokens, const size_t *pos, float *const *logits,
                            void *batch_work);
int s3d8_linear_s3d8_at(int v, int threads, size_t m, size_t n, size_t k, uintptr_t x,
                        size_t x_stride, uintptr_t packed, uintptr_t table, uintptr_t w_scale,
                        uintptr_t y, size_t y_stride, uintptr_t work);
int s3d8_linear_qsi8_at(int v, int threads, size_t m, size_t n, size_t k, uintptr_t x,
                        size_t x_stride, uintptr_t w, size_t w_stride, uintptr_t w_scale,
                        uintptr_t y, size_t y_stride, uintptr_t work);
"""
# The hot small-m calls take addresses as integers (tensor.data_ptr()): a cffi pointer cast per
# argument would cost more than the kernel for small matrices.
WRAPPERS = """
#include "s3d8.h"
static int s3d8_linear_s3d8_at(int v, int threads, size_t m, size_t n, size_t k, uintptr_t x,
                               size_t x_stride, uintptr_t packed, uintptr_t table,
                               uintptr_t w_scale, uintptr_t y, size_t y_stride, uintptr_t work) {
    return s3d8_linear_s3d8(v, threads, m, n, k, (const float *)x, x_stride, (const uint8_t *)packed,
                            (const int8_t *)table, (const uint16_t *)w_scale, (float *)y, y_stride,
                            (void *)work);
}
static int s3d8_linear_qsi8_at(int v, int threads, size_t m, size_t n, size_t k, uintptr_t x,
                               size_t x_stride, uintptr_t w, size_t w_stride, uintptr_t w_scale,
                               uintptr_t y, size_t y_stride, uintptr_t work) {
    return s3d8_linear_qsi8(v, threads, m, n, k, (const float *)x, x_stride, (const int8_t *)w,
                            w_stride, (const uint16_t *)w_scale, (float *)y, y_stride, (void *)work);
}
"""


def host_cc() -> list[str]:
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def target_of(cc: list[str]) -> tuple[str, str]:
    """(architecture, triple) the compiler builds for, e.g. ("aarch64", "aarch64-linux-gnu")."""
    triple = subprocess.run([*cc, "-dumpmachine"], check=True, capture_output=True,
                            text=True).stdout.strip()
    arch = triple.split("-")[0]
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)
    if arch not in LIBRARY:
        raise SystemExit(f"native/build.py: no kernels for target {triple!r} (have {sorted(LIBRARY)})")
    return arch, triple


def run(cmd: list[str]) -> None:
    print("  " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True)


def compile_library(cc: list[str], out_dir: Path, extra: list[str]) -> list[Path]:
    arch, _ = target_of(cc)
    out_dir.mkdir(parents=True, exist_ok=True)
    objects = []
    for source, flags in LIBRARY[arch].items():
        obj = out_dir / (Path(source).stem + ".o")
        run([*cc, *COMMON_FLAGS, *flags, *extra, "-I", str(NATIVE), "-c", str(NATIVE / source),
             "-o", str(obj)])
        objects.append(obj)
    return objects


def make_ffi(objects: list[Path], **kwargs):
    """The cffi (API mode) builder of ``pipeline._s3d8_native``: the wrappers, linked with the library
    objects ``objects`` (from :func:`compile_library`)."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source("pipeline._s3d8_native", WRAPPERS, include_dirs=[str(NATIVE)],
                   extra_objects=[str(o) for o in objects], extra_compile_args=["-O2"],
                   extra_link_args=["-fopenmp"], **kwargs)
    return ffi


def ffibuilder():
    """Entry point of cffi's setuptools integration (``cffi_modules=["native/build.py:ffibuilder"]`` in
    setup.py): the extension without its library objects, which setup.py's ``build_ext`` compiles with
    :func:`compile_library` (each ISA file with its own flags) into its build directory and adds just
    before the extension is compiled. Not the limited API, so the module is named like the one
    ``python native/build.py`` builds (``_s3d8_native.cpython-*.so``)."""
    return make_ffi([], py_limited_api=False)


def build_extension(force: bool = False) -> Path:
    """Compile the library and its cffi (API mode) wrapper into pipeline/_s3d8_native*.so
    (skipped when it is newer than every source)."""
    existing = sorted((ROOT / "pipeline").glob("_s3d8_native.*.so"))
    newest_source = max(p.stat().st_mtime for p in [*NATIVE.glob("*.[ch]"), Path(__file__)])
    if existing and not force and existing[-1].stat().st_mtime > newest_source:
        print(f"native/build.py: {existing[-1].relative_to(ROOT)} is up to date")
        return existing[-1]
    cc = host_cc()
    arch, triple = target_of(cc)
    out_dir = BUILD / f"ext-{triple}"
    objects = compile_library(cc, out_dir, ["-fPIC"])
    ffi = make_ffi(objects)
    built = Path(ffi.compile(tmpdir=str(out_dir), verbose=False))
    target = ROOT / "pipeline" / built.name
    tmp = target.with_name(target.name + ".tmp")
    shutil.copy2(built, tmp)
    os.replace(tmp, target)  # a new file: a running process keeps its mapping of the old one
    print(f"native/build.py: built {target.relative_to(ROOT)} ({arch})")
    return target


def build_program(name: str, cc: list[str] | None = None, out: Path | None = None,
                  static: bool = False, sanitize: str | None = None) -> Path:
    """Compile a standalone program (no Python) from native/<name>.c and the library."""
    if name not in PROGRAMS:
        raise SystemExit(f"native/build.py: unknown program {name!r} (have {', '.join(PROGRAMS)})")
    cc = cc or host_cc()
    arch, triple = target_of(cc)
    tag = triple + (f"-{sanitize}" if sanitize else "") + ("-static" if static else "")
    out = out or BUILD / tag / name
    extra = ["-g", f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"] if sanitize else []
    objects = compile_library(cc, out.parent / "obj", extra)
    link = (["-static"] if static else []) + extra + ["-fopenmp", "-lm"]
    if "android" in triple:
        link.append("-static-openmp")  # the NDK's libomp is not on the device
    run([*cc, *COMMON_FLAGS, *extra, "-fopenmp", "-I", str(NATIVE), str(NATIVE / f"{name}.c"),
         *map(str, objects), "-o", str(out), *link])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="rebuild the extension even if up to date")
    sub = parser.add_subparsers(dest="what")
    prog = sub.add_parser("program", help="build a standalone program")
    prog.add_argument("name", choices=PROGRAMS)
    prog.add_argument("--cc", help="compiler command (default: $CC or Python's), e.g. aarch64-linux-gnu-gcc")
    prog.add_argument("--out", type=Path)
    prog.add_argument("--static", action="store_true", help="link statically (run under qemu without a sysroot)")
    prog.add_argument("--sanitize", help="e.g. address or address,undefined")
    args = parser.parse_args(argv)
    if args.what == "program":
        path = build_program(args.name, shlex.split(args.cc) if args.cc else None, args.out,
                             args.static, args.sanitize)
        print(f"native/build.py: built {path}")
    else:
        build_extension(force=args.force)


if __name__ == "__main__":
    sys.exit(main())
