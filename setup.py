"""Build hooks that pyproject.toml cannot express (everything else lives there).

- The native kernel library: cffi's setuptools integration (``cffi_modules``) adds the extension
  ``pipeline._s3d8_native``; its library objects are compiled here, each ISA file with its own flags
  (``native/build.py``'s ``compile_library``), into the build directory, just before cffi generates and
  compiles the wrapper. A wheel therefore holds ``pipeline/_s3d8_native.cpython-*.so``; an editable
  install builds it in place (replaced atomically: a running process keeps its mapping of the old file).
- The prompt pool ``data/prompts/prompt_pool.yaml`` (where the DVC pipeline reads it) is copied into the
  package as ``pipeline/data/prompt_pool.yaml``, so an installed package has it without the repository.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
POOL = Path("data") / "prompts" / "prompt_pool.yaml"
POOL_IN_PACKAGE = Path("pipeline") / "data" / "prompt_pool.yaml"


def _native_build():
    spec = importlib.util.spec_from_file_location("_s3d8_native_build", HERE / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildExt(build_ext):
    def pre_run(self, ext, ffi) -> None:
        """Called by cffi before it writes the wrapper's C source: compile the library objects."""
        native = _native_build()
        objects = native.compile_library(native.host_cc(), Path(self.build_temp) / "s3d8-library", ["-fPIC"])
        ext.extra_objects = [str(o) for o in objects]
        ext.depends = [*ext.depends, *ext.extra_objects]   # relink whenever the objects are rebuilt

    def copy_extensions_to_source(self) -> None:
        """In-place (editable) builds: a new file renamed over the old one, never rewritten in place."""
        build_py_cmd = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py_cmd, ext)
            tmp = f"{inplace_file}.tmp{os.getpid()}"
            shutil.copy2(regular_file, tmp)
            os.replace(tmp, inplace_file)


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return                      # the editable package reads the pool from the repository
        target = Path(self.build_lib) / POOL_IN_PACKAGE
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HERE / POOL, target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(str(Path(self.build_lib) / POOL_IN_PACKAGE))
        return outputs


setup(cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
      cffi_modules=["native/build.py:ffibuilder"])
