"""S3D8 pipeline: formats, quantised modules, data, models, evaluation, packed-file IO, native bindings.

Importing ``pipeline`` registers the packed formats with transformers (``pipeline/hf/quantizer.py``), so that
``AutoModelForImageTextToText.from_pretrained`` (``AutoModelForCausalLM`` for a text-only Llama) loads a packed
model directory with its weights kept packed, ``save_pretrained`` writes it back, and a checkpoint of packed
tensors without their quantization config is refused rather than loaded as random weights. The registration runs when
transformers itself is imported (at once if it already is), so that ``import pipeline`` stays cheap for the
tools that never load a model.
"""

import importlib.abc
import importlib.util
import sys

from pipeline import moved

__version__ = "0.1.0"


def _register_with_transformers() -> None:
    from pipeline.hf import quantizer  # noqa: F401  (registers itself at the end of its import)


class _AfterTransformersImport(importlib.abc.MetaPathFinder):
    """Runs the registration right after ``transformers`` is first imported (once)."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register_with_transformers()

        spec.loader.exec_module = exec_then_register
        return spec


if "transformers" in sys.modules:
    _register_with_transformers()
elif not any(isinstance(f, _AfterTransformersImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterTransformersImport())
moved.install()
