"""The post-training cast: from the float teacher to a packed format without training.

- :mod:`pipeline.cast.fit`: each format's state (S3D8 tables, code points) fitted to every quantised weight (stage
  fit-centroids).
- :mod:`pipeline.cast.calibrate`: ``X^T X`` of the teacher's inputs to every Linear (stage calibrate).
- :mod:`pipeline.cast.ptq`: one weight cast by an algorithm (``absmax``, ``search``, ``gptq``); the formats do the
  numerics.
- :mod:`pipeline.cast.sequential`: each matrix's ``X^T X`` from the model with every earlier matrix already cast.
- :mod:`pipeline.cast.rotate`: the exact residual-stream rotation done before a cast.
- :mod:`pipeline.cast.direct`: the direct cast's files (one per decoder layer) and their reader;
  :mod:`pipeline.cast.run`: stage direct-cast's run.
"""
