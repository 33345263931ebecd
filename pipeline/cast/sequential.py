"""Sequential post-training casting, as GPTQ does it: each matrix's ``X^T X`` is taken from the model with every
matrix that runs before it already replaced by its cast.

The model's repeated blocks (every ``nn.ModuleList`` whose entries hold a Linear: a Llama's decoder layers; Mllama's
vision encoder layers, global layers and text layers) are walked in the order the forward calls them. The inputs of
a list's first block are captured once per calibration sequence (the forward is stopped there, so the blocks and
modules before it run with their casts already in place); then block by block:

1. the block's Linears are grouped by the input they read (``q/k/v``, then ``o``, then ``gate/up``, then ``down`` in
   a Llama layer: GPTQ's "true sequential" order), and each group's ``X^T X`` is summed over the calibration tokens
   (float64) with the groups before it already cast, so ``o_proj`` sees the attention of cast ``q/k/v``;
2. each weight is cast (``cast(name, weight, hessian) -> decoded weight``) and the decoded weight replaces it;
3. the block's outputs, computed with its casts, are the next block's inputs.

What is left (the modules outside every block list: embeddings, ``lm_head``, Mllama's projector) is cast last, with
``X^T X`` from one forward of the cast model; a tied embedding is cast with its ``lm_head``'s ``X^T X`` (the matrix's
error matters where it is an output head; as an embedding its rows are only looked up), and an untied embedding has
none (``cast`` gets ``None``). A module the calibration never calls gets ``None`` too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipeline.cast import ptq
from pipeline.models import quantised_weight_names

Cast = Callable[[str, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``cast(checkpoint name P, float32 weight, X^T X / n or None) -> the decoded float32 weight``."""


class _Stop(Exception):
    pass


def block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """``(name, list)`` of the model's lists of blocks: each entry holds an ``nn.Linear`` (outermost lists only)."""
    found = []
    for name, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and len(module)
                and all(any(isinstance(m, nn.Linear) for m in b.modules()) for b in module)
                and not any(name.startswith(f"{outer}.") for outer, _ in found)):
            found.append((name, module))
    return found


_CACHES = ("cache", "past_key_values", "past_key_value")


def _call(model: nn.Module, inputs: dict) -> None:
    """A forward without a KV cache: a block run again must not attend to the keys of its earlier runs."""
    with torch.no_grad():
        model(**inputs, use_cache=False)


def _calls(model: nn.Module, lists, inputs: dict) -> tuple[list, set[int]]:
    """``lists`` in the order one forward reaches them (those it reaches), and the ids of the blocks it calls (a
    Mllama cross-attention layer is skipped on text alone)."""
    order, called = [], set()

    def seen(i, block):
        def pre(module, args, kwargs):
            called.add(id(block))
            if i not in order:
                order.append(i)
        return pre

    handles = [b.register_forward_pre_hook(seen(i, b), with_kwargs=True)
               for i, (_, blocks) in enumerate(lists) for b in blocks]
    try:
        _call(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return [lists[i] for i in order], called


def _capture(model: nn.Module, block: nn.Module, inputs: Sequence[dict]) -> list[tuple[tuple, dict]]:
    """The ``(args, kwargs)`` each calibration sequence calls ``block`` with (the forward stops there)."""
    seen = []

    def pre(module, args, kwargs):
        seen.append((args, {k: None if k in _CACHES else v for k, v in kwargs.items()}))
        raise _Stop

    handle = block.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        for batch in inputs:
            try:
                _call(model, batch)
            except _Stop:
                pass
    finally:
        handle.remove()
    if len(seen) != len(inputs):
        raise ValueError(f"sequential cast: a block list was reached by {len(seen)} of {len(inputs)} calibration "
                         "sequences")
    return seen


def _hidden(args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.Tensor]:
    if args:
        return args, kwargs, args[0]
    key = next(k for k in ("hidden_states", "hidden_state") if k in kwargs)
    return args, kwargs, kwargs[key]


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    key = next(k for k in ("hidden_states", "hidden_state") if k in kwargs)
    return args, {**kwargs, key: hidden}


def _run_block(block: nn.Module, calls) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for args, kwargs in calls:
            out = block(*args, **kwargs)
            outs.append(out[0] if isinstance(out, (tuple, list)) else out)
    return outs


def _linear_groups(block: nn.Module, calls) -> list[list[str]]:
    """The block's Linears (names within it) in the order it calls them, those that read one input together."""
    order: list[tuple[str, torch.Tensor]] = []     # the inputs kept alive, compared by identity
    linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    handles = [m.register_forward_pre_hook(lambda m, a, n=n: order.append((n, a[0])))
               for n, m in linears.items()]
    try:
        _run_block(block, calls[:1])
    finally:
        for h in handles:
            h.remove()
    groups: list[list[str]] = []
    last = None
    for name, source in order:
        if any(name in g for g in groups):
            continue
        if last is not None and source is last and groups:
            groups[-1].append(name)
        else:
            groups.append([name])
        last = source
    return groups


def hessians(run: Callable[[], None], modules: dict[str, nn.Linear]) -> dict[str, torch.Tensor]:
    """``X^T X / n_rows`` (float32) of each Linear's inputs while ``run()`` runs (``ptq.input_sums``)."""
    return ptq.input_sums(run, modules, lambda x: x.T @ x)


def cast_sequentially(model: nn.Module, inputs: Sequence[dict], cast: Cast,
                      done: Callable[[list[str]], None] | None = None, on_block=None) -> None:
    """Cast every weight the recipe quantises (``cast`` once per checkpoint name), sequentially (module doc).
    ``inputs``: the calibration sequences as model keyword arguments, one sequence each (no padding). The model's
    weights are replaced by their casts in place. ``done(names)`` is called after each block's weights are cast
    (``on_block()`` too, for progress)."""
    saved = quantised_weight_names(model)                     # module name -> checkpoint name of its weight
    finished: set[str] = set()

    def apply(module_name: str, module: nn.Module, hessian) -> None:
        name = saved[module_name].removesuffix(".weight")
        decoded = cast(name, module.weight.detach().float(), hessian)
        module.weight.data.copy_(decoded.to(module.weight.dtype))
        finished.add(name)

    lists, called = _calls(model, block_lists(model), inputs[0]) if inputs else ([], set())
    for list_name, blocks in lists:
        first = next(b for b in blocks if id(b) in called)
        calls = _capture(model, first, inputs)
        for i, block in enumerate(blocks):
            prefix = f"{list_name}.{i}"
            for group in _linear_groups(block, calls) if id(block) in called else []:
                mods = {n: block.get_submodule(n) for n in group}
                found = hessians(lambda: _run_block(block, calls), mods)
                for n in group:
                    apply(f"{prefix}.{n}", mods[n], found.get(n))
            rest = [(n, m) for n, m in block.named_modules()
                    if f"{prefix}.{n}" in saved and saved[f"{prefix}.{n}"].removesuffix(".weight") not in finished]
            for n, m in rest:                                   # quantised modules the block never called
                apply(f"{prefix}.{n}", m, None)
            names = sorted({saved[f"{prefix}.{n}"].removesuffix(".weight") for n, _ in block.named_modules()
                            if f"{prefix}.{n}" in saved})
            if id(block) in called:
                outs = _run_block(block, calls)
                calls = [_with_hidden(*_hidden(a, k)[:2], o) for (a, k), o in zip(calls, outs)]
            if done is not None:
                done(names)
            if on_block is not None:
                on_block()
    left = {m: s.removesuffix(".weight") for m, s in saved.items() if s.removesuffix(".weight") not in finished}
    linears = {m: model.get_submodule(m) for m in left if isinstance(model.get_submodule(m), nn.Linear)}
    found = hessians(lambda: [_call(model, b) for b in inputs], linears) if linears else {}
    by_name: dict[str, torch.Tensor] = {}
    for m in sorted(found):                     # a tied matrix takes its Linear's X^T X (the output head's)
        by_name.setdefault(left[m], found[m])
    cast_now: dict[str, str] = {}
    for m, name in left.items():
        cast_now.setdefault(name, m)
    for name, m in cast_now.items():
        apply(m, model.get_submodule(m), by_name.get(name))
    if done is not None and cast_now:
        done(sorted(cast_now))
