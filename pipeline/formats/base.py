"""The interface every weight format offers, and the input checks they share."""

from __future__ import annotations

import json
import math
from typing import Protocol

import torch

from pipeline.formats.numerics import GPTQ_ACT_ORDER

State = dict[str, torch.Tensor]
"""A format's fitted state (centroid table, code points): named tensors, stored as safetensors."""


class Format(Protocol):
    name: str

    def fit(self, weight: torch.Tensor, seed: int = 0) -> State:
        """Fit the format's state (deterministic for a seed) to one weight matrix."""

    def quantize(self, weight: torch.Tensor, state: State) -> torch.Tensor:
        """Fake-quantised weight: same shape and dtype, straight-through gradient."""

    def bits_per_param(self, shape: tuple[int, int]) -> float:
        """Nominal bits per parameter, counted as the paper does (no padding, no tables)."""

    def storage_bytes(self, shape: tuple[int, int]) -> int:
        """Bytes the packed tensors really take: codes, scales, tables and padding."""


def check_weight(weight: torch.Tensor, what: str = "weight") -> None:
    """Reject what no format can quantise: wrong rank, integer dtype, NaN or Inf."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D tensor [d_out, d_in], got rank {weight.dim()} "
                         f"(shape {tuple(weight.shape)})")
    if not weight.is_floating_point():
        raise ValueError(f"{what}: expected a floating-point dtype, got {weight.dtype}")
    w = weight.detach()
    # amax/amin propagate NaN and keep Inf: two reductions instead of a full boolean copy.
    if w.numel() and not (torch.isfinite(w.amax()) and torch.isfinite(w.amin())):
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        raise ValueError(f"{what}: contains NaN or Inf (first at index {bad})")


def check_shape(shape) -> tuple[int, int]:
    if len(shape) != 2 or any(int(s) < 1 for s in shape):
        raise ValueError(f"shape: expected (d_out, d_in) with positive sizes, got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


LOG2_6 = math.log2(6)


PackedSpecs = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""The tensors one packed weight is stored as: ``{suffix: (dtype, shape)}``, saved as ``P.weight.<suffix>``."""


class FormatBase:
    """What every format shares: its identity, the fitted-state file, and (for formats with a packed
    layout) the packed tensors of one weight. A format module subclasses it and fills in its own parts.

    Capability flags tell the rest of the pipeline what a format can do, so no other module asks for
    a format by name: ``comparison`` (one of the paper's 2.6-2.7-bit formats: fitted, trained, packed
    and evaluated by the DVC matrix), ``native_kernel`` (the native kernels run its packed bytes).
    """

    name: str = ""
    label: str = ""                       # how reports name it ("S3D8", "student-t" ...)
    comparison: bool = False
    native_kernel: bool = False
    layout: str | None = None             # the packed file's layout name (metadata ``layout``); None: not packable
    reader: str = ""                      # another program that reads its packed files, for model cards
    suffixes: tuple[str, ...] = ()        # packed tensors of one weight, ``P.weight.<suffix>``

    def __repr__(self) -> str:
        return f"<format {self.name}>"

    @property
    def quant_method(self) -> str:
        """``quantization_config.quant_method`` of its packed Hugging Face directories."""
        return f"s3d8-pipeline-{self.name}"

    # --- packed tensors of one weight (formats with a layout override these) ---------------------------

    def stored_names(self, name: str) -> dict[str, str]:
        """The file's tensor names of the weight ``name`` (``P.weight``) by part: ``P.weight.<suffix>``."""
        return {s: f"{name}.{s}" for s in self.suffixes}

    def stored(self, tensors, name: str) -> dict[str, torch.Tensor]:
        """The parts of the weight ``name`` (``{suffix: tensor}``) from a file's ``tensors`` (name -> tensor)."""
        return {s: tensors[key] for s, key in self.stored_names(name).items()}

    def packed_specs(self, shape: tuple[int, int], state: State) -> PackedSpecs:
        raise ValueError(f"format {self.name!r} has no packed layout")

    def pack(self, weight: torch.Tensor, state: State) -> dict[str, torch.Tensor]:
        """The packed tensors of ``weight`` (``{suffix: tensor}``, as :meth:`packed_specs` describes them)."""
        raise ValueError(f"format {self.name!r} has no packed layout")

    def unpack(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """Decode packed tensors back to the ``float32 [d_out, d_in]`` weight (equal to :meth:`quantize`)."""
        raise ValueError(f"format {self.name!r} has no packed layout")

    def row_block(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int], r0: int,
                  r1: int) -> tuple[dict[str, torch.Tensor], tuple[int, int]] | None:
        """The packed tensors of rows ``r0 .. r1`` of a weight (``r0`` a multiple of 3) as a weight of their
        own, so that decoding them gives exactly those rows of the whole decoded weight; None when the
        layout cannot be sliced by rows (the caller then decodes the whole weight)."""
        return None

    def native_linear(self, tensors: dict[str, torch.Tensor], shape, bias: torch.Tensor | None):
        """An ``nn.Module`` running the packed ``tensors`` on the native kernels (INT8 activations per token)."""
        raise ValueError(f"format {self.name!r} has no native kernel")

    def row_embedding(self, tensors: dict[str, torch.Tensor], shape, padding_idx: int | None = None,
                      dtype: torch.dtype = torch.float32):
        """An embedding over the packed ``tensors`` that decodes only the rows it looks up (the native runtime's)."""
        raise ValueError(f"format {self.name!r} has no row embedding")

    def file_metadata(self) -> dict[str, str]:
        """Extra metadata a packed file of this format carries (e.g. an interoperability marker)."""
        return {}

    # --- scales and post-training methods (the comparison formats override these) ----------------------
    # ``pipeline.cast.ptq`` calls them for the methods ``search`` and ``gptq`` and for the QAT start; the QAT forward
    # at a learned scale (``pipeline.qat.modules``) uses ``values_at_scale`` and ``expand_scale``.

    refits_state = False                  # ``refit_state`` refits the fitted state on trained weights (qat.refit_table)

    def _no_ptq(self, what: str):
        raise ValueError(f"format {self.name!r} has no {what} (only the comparison formats have)")

    def absmax_scale(self, weight: torch.Tensor) -> torch.Tensor:
        """The bf16 scale the format's own ``quantize`` derives from ``weight`` (per row ``[d_out, 1]`` or per
        block ``[d_out, n_blocks]``)."""
        self._no_ptq("scales")

    def expand_scale(self, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """``scale`` (as :meth:`absmax_scale` lays it out) broadcast to one value per weight, ``[d_out, d_in]``."""
        self._no_ptq("scales")

    def state_of(self, tensors: dict[str, torch.Tensor]) -> State:
        """The quantiser state (the fitted part) that packed ``tensors`` were written with."""
        self._no_ptq("post-training methods")

    def pack_at_scale(self, weight: torch.Tensor, state: State, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """The packed tensors of ``weight`` with quantiser ``state`` and bf16 ``scale`` (codes: nearest table entry
        or code point of the weight over its scale, no clamping)."""
        self._no_ptq("post-training methods")

    def values_at_scale(self, weight: torch.Tensor, state: State, scale: torch.Tensor) -> torch.Tensor:
        """``unpack(pack_at_scale(...)) / scale``: each weight's code value in units of its scale, float32
        ``[d_out, d_in]``; times ``expand_scale(scale)`` it is the decoded weight, bit for bit."""
        self._no_ptq("post-training methods")

    def search(self, weight: torch.Tensor, importance: torch.Tensor | None = None, *, seed: int = 0,
               fitted: State | None = None) -> tuple[State, torch.Tensor]:
        """The ``search`` method: ``(state, scale)`` minimising the ``importance``-weighted reconstruction error,
        starting from ``fitted`` (``fit(weight, seed)``'s state; fitted here when None)."""
        self._no_ptq("post-training methods")

    def gptq(self, weight: torch.Tensor, hessian: torch.Tensor, *, seed: int = 0, fitted: State | None = None,
             compensated: torch.Tensor | None = None,
             act_order: bool = GPTQ_ACT_ORDER) -> dict[str, torch.Tensor]:
        """The ``gptq`` method: packed tensors by error feedback through ``hessian`` on top of the search's start;
        ``compensated`` (float32 ``[d_out, d_in]``) receives the error-compensated weights it rounded;
        ``act_order``: the columns by decreasing ``H[k, k]`` (``numerics.gptq``)."""
        self._no_ptq("post-training methods")

    def whole_codes(self, same: torch.Tensor) -> torch.Tensor:
        """Given where a weight's own code is kept (bool ``[d_out, d_in]``), where it can be: a format whose
        weights share codes keeps all of a code's weights or none."""
        return same

    def refit_state(self, weight: torch.Tensor, scale: torch.Tensor, importance: torch.Tensor,
                    state: State) -> State:
        """The state refitted on ``weight`` over ``scale`` (``refits_state`` formats)."""
        self._no_ptq("state refit")

    # --- fitted states of a whole model ---------------------------------------------------------------

    def save_states(self, path, states: dict[str, State], metadata: dict | None = None) -> None:
        """Write fitted states: the tensor ``key`` of the weight ``P.weight`` as ``P.weight.key`` (the
        packed file's naming); metadata names the format. Same states, same bytes."""
        from pipeline.packed.safetensors_io import write_tensors

        tensors = {f"{module}.weight.{key}": t.contiguous() for module, st in states.items()
                   for key, t in st.items()}
        meta = {"format": self.name, "modules": json.dumps(list(states))}
        meta.update({k: v if isinstance(v, str) else json.dumps(v, sort_keys=True)
                     for k, v in (metadata or {}).items()})
        write_tensors(path, tensors, meta)

    def load_states(self, path) -> dict[str, State]:
        """Read the states written by :meth:`save_states`; a file of another format is an error naming it."""
        from pathlib import Path

        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: fitted-state file not found (run the fit-centroids stage)")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != self.name:
                    raise ValueError(f"{path}: holds the state of format {meta.get('format')!r}, not {self.name!r}")
                modules = json.loads(meta.get("modules", "[]"))
                if not isinstance(modules, list):
                    raise ValueError(f"{path}: metadata 'modules' is not a list")
                states: dict[str, State] = {m: {} for m in modules}
                for name in f.keys():
                    weight, _, key = name.rpartition(".")
                    states.setdefault(weight.removesuffix(".weight"), {})[key] = f.get_tensor(name)
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own errors for truncated or foreign files
            raise ValueError(f"{path}: not a readable fitted-state file ({type(e).__name__}: {e})") from None
        return states
