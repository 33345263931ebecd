"""S3D8 pipeline: formats, quantised modules, data, models, evaluation, packed-file IO, native bindings."""

__version__ = "0.1.0"
