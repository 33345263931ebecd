"""calibrate.hessian_memory_gb bounds the real peak of a pass: every tensor alive while the sums are collected,
counted as torch allocates and frees it (``calibrate.peak_bytes``: the float64 sums and one update's temporaries)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those made inside the mode (an op's output that aliases
    an input, a view or an in-place result, allocates nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) not in self.live:
                    self.live[id(storage)] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, id(storage))
        return out


def test_a_pass_never_holds_more_than_the_budget():
    from pipeline.cast import ptq
    from pipeline.cast.calibrate import passes, peak_bytes

    torch.manual_seed(0)
    widths = [256, 384, 256, 320, 192]
    model = torch.nn.Sequential(*[torch.nn.Linear(d, widths[i + 1] if i + 1 < len(widths) else 64)
                                  for i, d in enumerate(widths)])
    names = [str(i) for i in range(len(widths))]
    batches = [torch.randn(1, 16, widths[0]) for _ in range(3)]
    budget = 3e6                    # two passes; a pass as the sums were made before (a new sum beside the old
    #                                 one, the float32 means beside every float64 sum) would exceed it
    groups = passes(widths, budget, rows=16)
    assert len(groups) > 1
    for a, b in groups:
        with LiveBytes() as mode:
            found = ptq.collect_hessians(model, batches, names[a:b])
        assert set(found) == set(names[a:b])
        assert 0.9 * peak_bytes(widths[a:b], 16) <= mode.peak <= peak_bytes(widths[a:b], 16) <= budget, (a, b)
