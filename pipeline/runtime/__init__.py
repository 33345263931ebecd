"""The generation runtime on packed models (``python -m pipeline.runtime``, ``s3d8 generate``).

- :mod:`pipeline.runtime.generation`: loading a packed model and generating from it, the lean loop and Hugging
  Face's, and the command line.
- :mod:`pipeline.runtime.models`: the models it runs (our lean Llama over the packed tensors, the Hugging Face
  Llama and Mllama with native modules swapped in, the vision encoder).
- :mod:`pipeline.runtime.decode_step`: one decode token as one C call over the same weights and caches.
"""

_API = frozenset(['DEFAULT_IMPL', 'IMPLS', 'Result', 'Sampling', 'THREADS_HELP', 'TextStream', 'available_cpus', 'begin', 'build_parser', 'check_threads', 'context_length', 'eos_ids', 'generate', 'hf_generate', 'lean_generate', 'load', 'main', 'packed_file', 'pick', 'stop_tokens'])


def __getattr__(name: str):
    """The names ``pipeline.runtime`` held when it was one module (``pipeline.runtime.generation`` now), imported on first use."""
    if name in _API:
        from pipeline.runtime import generation
        return getattr(generation, name)
    raise AttributeError(f"module 'pipeline.runtime' has no attribute {name!r}")
