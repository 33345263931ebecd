"""The teacher and what it produces.

- :mod:`pipeline.teacher.source`: where the teacher comes from (the ``teacher`` parameters) and where its files are.
- :mod:`pipeline.teacher.importer`: ``python -m pipeline.teacher import SOURCE OUT_DIR``, a GGUF
  (:mod:`pipeline.teacher.gguf_import`) or a Hugging Face directory written as a bf16 teacher directory.
- :mod:`pipeline.teacher.prompts`, :mod:`pipeline.teacher.sample`: the prompts it is asked (stage sample-prompts).
- :mod:`pipeline.teacher.generate_answers`: its answers (stage teacher-generate), :mod:`pipeline.teacher.diversity`
  their variety.
- :mod:`pipeline.teacher.answers`: its answers as data (training and held-out split, batches);
  :mod:`pipeline.teacher.logits`: its logits at the response positions, computed once.
"""

from pipeline.moved import package_getattr

__getattr__ = package_getattr(__name__)
