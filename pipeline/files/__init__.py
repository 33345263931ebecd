"""The files stages write and read: :mod:`pipeline.files.atomic` (temporary file, then rename),
:mod:`pipeline.files.shards` (Parquet shards with provenance), :mod:`pipeline.files.hashes` (fingerprints)."""
