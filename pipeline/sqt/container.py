"""The ``.sqt`` v3 file's layout (SPEC section 9), shared by the exporter (:mod:`pipeline.sqt.write`) and the reader
(:mod:`pipeline.sqt.read`): the prefix constants and dtypes, the metadata keys the engine requires, a header
entry and its byte length, and :class:`SqtError`. It imports no other ``sqt`` module, so both sides can."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from pipeline.packed.layout import packed_shape

MAGIC = b".sqt"
VERSION = 3
DEFAULT_ALIGNMENT = 32
PREFIX_BYTES = 16                  # magic, version, header length
DTYPES = ("BF16", "INT8", "S3D8")
FORCE_BF16 = (                    # quantised in the packed file, decoded and stored as BF16 (SPEC section 9)
    "vision_model.multi_modal_projector.weight",
    "vision_model.gated_positional_embedding.tile_embedding.weight",
    "vision_model.pre_tile_positional_embedding.embedding.weight",
    "vision_model.post_tile_positional_embedding.embedding.weight",
)
TEXT_KEYS = {"d_layers": int, "d_vocab": int, "d_model": int, "d_mlp": int, "d_attention_head": int,
             "d_attention_q": int, "d_attention_kv": int, "d_sequence_max": int, "norm_epsilon": float,
             "rope_angular_frequency": list, "tied_embeddings": bool, "cross_attention_layers": list}
VISION_KEYS = {"image_mean": list, "image_std": list, "d_image": int, "d_patch": int, "d_layers0": int,
               "d_layers1": int, "d_model": int, "d_mlp": int, "d_attention_head": int,
               "d_attention_qkv": int, "norm_epsilon": float, "output_taps": list}
VOCAB_KEYS = {"chat_template": str, "begin_of_text_id": int, "start_header_id": int, "end_header_id": int,
              "eot_id": int, "stop_token_ids": list, "image_id": (int, type(None)), "pre_tokenizer": str,
              "merges": list, "vocab": list}
METADATA_KEYS = {"source": str, "created": str, "alignment": int, "config": dict, "vocab": dict}


class SqtError(ValueError):
    """A ``.sqt`` file (or an export's input) the engine would not load: the message names the file and field."""


def align(n: int, alignment: int) -> int:
    return n + (-n % alignment)


# --- the header's tensor entries --------------------------------------------------------------------------


@dataclass
class Entry:
    """One header entry ``{dtype, shape, data_offsets}`` (with nested ``table`` / ``scale`` entries)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0
    table: Entry | None = None
    scale: Entry | None = None

    @property
    def nbytes(self) -> int:
        return expected_bytes(self.dtype, self.shape)

    def to_json(self) -> dict:
        d = {"dtype": self.dtype, "shape": list(self.shape), "data_offsets": [self.begin, self.end]}
        if self.table is not None:
            d["table"] = self.table.to_json()
        if self.scale is not None:
            d["scale"] = self.scale.to_json()
        return d

    def parts(self) -> Iterator[Entry]:
        """Data, table, scale: the buffer order."""
        yield self
        if self.table is not None:
            yield self.table
        if self.scale is not None:
            yield self.scale


def expected_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    if dtype == "BF16":
        return 2 * math.prod(shape)
    if dtype == "INT8":
        return math.prod(shape)
    if dtype == "S3D8":
        return math.prod(packed_shape(*shape))
    raise ValueError(f"unknown dtype {dtype!r}")
