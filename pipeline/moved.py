"""Where the modules of the flat ``pipeline/`` of 0.1 live now (issue 39's move), so that code written against the
old names keeps working: ``import pipeline.runtime_models`` gives :mod:`pipeline.runtime.models` itself (one module
object under both names), with a ``DeprecationWarning`` that names the new home. The project's own code uses only
the new names (``tests/test_house.py`` checks). ``pipeline.packed``, ``pipeline.hf``, ``pipeline.runtime`` and
``pipeline.sqt`` became packages under the same names; each still answers the names the module had (its
``__getattr__``), and ``python -m pipeline.hf | pipeline.runtime | pipeline.sqt`` run as before.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "pipeline.layout": "pipeline.packed.layout",
    "pipeline.packed_modules": "pipeline.packed.modules",
    "pipeline.checkpoint": "pipeline.packed.checkpoint",
    "pipeline.safetensors_io": "pipeline.packed.safetensors_io",
    "pipeline.hf_config": "pipeline.hf.config",
    "pipeline.hf_write": "pipeline.hf.write",
    "pipeline.runtime_models": "pipeline.runtime.models",
    "pipeline.decode_step": "pipeline.runtime.decode_step",
    "pipeline.sqt_blocks": "pipeline.sqt.blocks",
    "pipeline.sqt_layout": "pipeline.sqt.container",
    "pipeline.sqt_read": "pipeline.sqt.read",
    "pipeline.report": "pipeline.eval.report",
    "pipeline.generate": "pipeline.teacher_generate",
    "pipeline.eval.prompts": "pipeline.eval.task_prompts",
    "pipeline.toy.teacher": "pipeline.toy.build",
    "pipeline.bench.report": "pipeline.bench.kernels_report",
}
"""Old module name -> the module that now holds the same code."""


class OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old name of :data:`MOVED` with the module at its new name (imported then, not before)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec      # the import system set the old name's spec on the shared module


def install() -> None:
    if not any(isinstance(f, OldNames) for f in sys.meta_path):
        sys.meta_path.append(OldNames())
