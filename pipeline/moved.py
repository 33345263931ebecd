"""Where the modules of the flat ``pipeline/`` of 0.1 live now (issue 39's moves), so that code written against the
old names keeps working: ``import pipeline.runtime_models`` gives :mod:`pipeline.runtime.models` itself (one module
object under both names), with a ``DeprecationWarning`` that names the new home. The project's own code uses only
the new names (``tests/test_house.py`` checks). ``pipeline.packed``, ``pipeline.hf``, ``pipeline.runtime``,
``pipeline.sqt``, ``pipeline.teacher``, ``pipeline.launch`` and ``pipeline.synthetic`` became packages under the same
names; each still answers the names the module had (:func:`package_getattr`), and ``python -m pipeline.hf |
pipeline.runtime | pipeline.sqt | pipeline.teacher | pipeline.launch | pipeline.synthetic`` run as before.
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
    "pipeline.generate": "pipeline.teacher.generate_answers",
    "pipeline.eval.prompts": "pipeline.eval.task_prompts",
    "pipeline.toy.teacher": "pipeline.toy.build",
    "pipeline.bench.report": "pipeline.bench.kernels_report",
    "pipeline.ptq": "pipeline.cast.ptq",
    "pipeline.calibrate": "pipeline.cast.calibrate",
    "pipeline.direct_cast": "pipeline.cast.direct",
    "pipeline.direct_cast_run": "pipeline.cast.run",
    "pipeline.sequential": "pipeline.cast.sequential",
    "pipeline.rotate": "pipeline.cast.rotate",
    "pipeline.fit": "pipeline.cast.fit",
    "pipeline.teacher_source": "pipeline.teacher.source",
    "pipeline.teacher_generate": "pipeline.teacher.generate_answers",
    "pipeline.teacher_logits": "pipeline.teacher.logits",
    "pipeline.gguf_import": "pipeline.teacher.gguf_import",
    "pipeline.answers": "pipeline.teacher.answers",
    "pipeline.prompts": "pipeline.teacher.prompts",
    "pipeline.sample": "pipeline.teacher.sample",
    "pipeline.diversity": "pipeline.teacher.diversity",
    "pipeline.synthetic_vision": "pipeline.synthetic.vision",
    "pipeline.mllama_shape": "pipeline.synthetic.shape",
    "pipeline.memory_plan": "pipeline.launch.memory_plan",
    "pipeline.processes": "pipeline.launch.processes",
    "pipeline.ranks": "pipeline.launch.ranks",
    "pipeline.io": "pipeline.files.atomic",
    "pipeline.shards": "pipeline.files.shards",
    "pipeline.filehash": "pipeline.files.hashes",
    "pipeline.precision": "pipeline.formats.precision",
    "pipeline.images": "pipeline.teacher.images",
}
"""Old module name -> the module that now holds the same code."""

PACKAGES = {
    "pipeline.packed": ("pipeline.packed.file", frozenset(['PACKED_VERSION', 'PackedWeight', 'bits_two_ways', 'is_vocabulary', 'load_packed_model', 'packed_format', 'plan_packed', 'read_metadata', 'write_packed'])),
    "pipeline.hf": ("pipeline.hf.quantizer", frozenset(['KERNELS', 'PackedHfQuantizer', 'PackedQuantConfig', 'register', 'resolve_kernel'])),
    "pipeline.runtime": ("pipeline.runtime.generation", frozenset(['DEFAULT_IMPL', 'IMPLS', 'Result', 'Sampling', 'THREADS_HELP', 'TextStream', 'available_cpus', 'begin', 'build_parser', 'check_threads', 'context_length', 'eos_ids', 'generate', 'hf_generate', 'lean_generate', 'load', 'main', 'packed_file', 'pick', 'stop_tokens'])),
    "pipeline.teacher": ("pipeline.teacher.importer", frozenset(['import_teacher', 'main'])),
    "pipeline.sqt": ("pipeline.sqt.write", frozenset(['ENGINE_DTYPES', 'export', 'main', 'resolve_model', 'standard_name'])),
    "pipeline.launch": ("pipeline.launch.launcher", frozenset(['command', 'main', 'plan_main'])),
    "pipeline.synthetic": ("pipeline.synthetic.text", frozenset(['BASE_STD', 'BLOCK_ELEMS', 'COL_SIGMA', 'DEFAULT_DIR', 'FORMATS', 'LINEARS', 'PRESETS', 'ROW_SIGMA', 'STUDENT_DF', 'block_rows', 'llama_config', 'main', 'stream_blocks', 'tensor_shapes', 'write_gguf', 'write_synthetic'])),
}
"""A package that replaced a module of the same name -> (the module that holds that module's code now, the names
code outside the project took from it)."""


def package_getattr(package: str):
    """The module ``__getattr__`` of ``package`` (:data:`PACKAGES`): an old name, imported from its new module on first
    use; anything else an AttributeError."""
    module, names = PACKAGES[package]

    def __getattr__(name: str):
        if name in names:
            return getattr(importlib.import_module(module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


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
