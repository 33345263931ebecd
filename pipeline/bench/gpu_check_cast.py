"""The direct cast of the GPU check (:mod:`pipeline.bench.gpu_check`): stage direct-cast's work on the device with a
synthetic ``X^T X`` per Linear, seconds per matrix and from them the 11B's cast on 1 and 8 GPUs, and one matrix cast
again on the CPU to compare. ``phases`` is the check's :class:`pipeline.bench.gpu_check.Phases`."""

from __future__ import annotations

import math
import time


def matrices(config) -> dict[str, tuple[tuple[int, int], bool]]:
    """``{checkpoint name P (of P.weight): ((d_out, d_in), has X^T X)}`` of a model config: the Linear layers have
    calibration data, the embeddings do not (as stage calibrate writes it)."""
    import torch

    from pipeline.models import meta_model, quantised_weight_names

    model = meta_model(config)
    return {saved.removesuffix(".weight"): (tuple(model.get_submodule(m).weight.shape),
                                            isinstance(model.get_submodule(m), torch.nn.Linear))
            for m, saved in quantised_weight_names(model).items()}


def synthetic_hessian(d_in: int, device, seed: int = 0):
    """A full-rank ``X^T X / n`` with correlated channels of different gains (float32, on ``device``)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed + d_in)
    n = d_in + 1024
    x = torch.randn(n, d_in, generator=gen, device=device)
    x += torch.randn(n, 64, generator=gen, device=device) @ torch.randn(64, d_in, generator=gen, device=device) / 8
    x *= torch.rand(d_in, generator=gen, device=device) * 3 + 0.1
    return x.T @ x / n


def time_of(shape, linear: bool, measured: dict) -> float:
    """Seconds for a matrix: measured for its shape, else scaled from the measured shape of the nearest cost (GPTQ's
    ``d_out x d_in^2`` for a Linear, the search's ``d_out x d_in`` for an embedding)."""
    if shape in measured:
        return measured[shape]

    def cost(s):
        return s[0] * s[1] * (s[1] if linear else 1)

    near = min(measured, key=lambda s: abs(math.log(cost(s) / cost(shape))))
    return measured[near] * cost(shape) / cost(near)


def predict_11b(measured: dict[tuple, float], processes: int) -> dict:
    """The 11B's direct cast from the per-shape seconds: its matrices dealt to ``processes`` as the stage deals
    them (``pipeline.cast.direct.deal``), the slowest process's seconds."""
    from pipeline.bench import skeleton_11b_steps as S
    from pipeline.cast import direct as direct_cast

    inventory = matrices(S.full_11b_config())
    group_seconds: dict[str, float] = {}
    for name, (shape, linear) in inventory.items():
        g = direct_cast.group_of(name)
        group_seconds[g] = group_seconds.get(g, 0.0) + time_of(shape, linear, measured)
    work = direct_cast.deal(group_seconds, processes)
    return {"matrices": len(inventory), "processes": processes,
            "unmeasured_shapes": sorted({str(s) for s, _ in inventory.values() if s not in measured}),
            "seconds": round(max(sum(group_seconds[g] for g in w) for w in work), 1),
            "seconds_one_process": round(sum(group_seconds.values()), 1)}


def cast_check(preset: str, algorithm: str, device, phases, compare: bool = True) -> dict:
    """Stage direct-cast's work on ``device``; writes ``<preset>/direct-cast/s3d8`` for :func:`qat_check`."""
    from pipeline.bench import skeleton_11b_steps as S
    from pipeline import formats
    from pipeline.cast import direct as direct_cast
    from pipeline.formats.precision import Precision
    from pipeline.packed.checkpoint import CheckpointReader
    from pipeline.files.atomic import atomic_dir

    d = S.dirs(preset)
    fmt = formats.get(formats.SUBJECT)
    states = fmt.load_states(d["states"])
    reader = CheckpointReader(d["model"])
    inventory = matrices(S.skeleton_config(S.PRESETS[preset]))
    phases.enter("cast_hessians")
    hessians = {shape[1]: synthetic_hessian(shape[1], device) for shape, linear in inventory.values() if linear}
    groups: dict[str, list[str]] = {}
    for name in inventory:
        groups.setdefault(direct_cast.group_of(name), []).append(name)
    phases.exit()

    def weight(name):
        return reader.get(f"{name}.weight").float().to(device)

    def fitted(name):
        return {k: v.to(device) for k, v in states[name].items()}

    def hessian(name):
        shape, linear = inventory[name]
        return hessians[shape[1]] if linear and algorithm == "gptq" else None

    seconds: dict[str, float] = {}
    order = [n for g in groups for n in groups[g]]
    clock = [time.perf_counter()]

    def on_matrix():
        phases.sync()
        now = time.perf_counter()
        seconds[order[len(seconds)]] = now - clock[0]
        clock[0] = now

    out_dir = d["model"].parent / "direct-cast" / fmt.name
    phases.enter("cast")
    with atomic_dir(out_dir) as out:
        for g, names in groups.items():
            clock[0] = time.perf_counter()
            direct_cast.cast_group(Precision(fmt), names, weight, fitted, hessian, algorithm, out / f"{g}.safetensors",
                                   "gpu-check", on_matrix=on_matrix)
        direct_cast.write_index(out, Precision(fmt), algorithm, groups, {"device": device.type})
    phases.exit()
    by_shape: dict[tuple, list[float]] = {}
    for name, sec in seconds.items():
        by_shape.setdefault(inventory[name][0], []).append(sec)
    measured = {shape: min(v) for shape, v in by_shape.items()}     # the first of a shape carries warm-up
    result = {"algorithm": algorithm, "device": str(device), "out_dir": str(out_dir), "matrices": len(seconds),
              "weights": sum(inventory[n][0][0] * inventory[n][0][1] for n in seconds),
              "seconds": phases.records["cast"]["seconds"],
              "seconds_by_shape": {str(s): round(v, 3) for s, v in sorted(measured.items())},
              "predicted_11b": [predict_11b(measured, k) for k in (1, 8)]}
    if compare:
        try:
            result["cpu_vs_device"] = compare_on_cpu(fmt, states, reader, inventory, hessians, algorithm, device)
        except Exception as e:  # noqa: BLE001  (the cast itself is done: QAT can start from it)
            result["cpu_vs_device"] = {"error": f"{type(e).__name__}: {e}"}
    return result


def compare_on_cpu(fmt, states, reader, inventory, hessians, algorithm: str, device) -> dict:
    """One matrix (the smallest square Linear) cast on the CPU (native kernels, every core) and on ``device``:
    seconds of each and how much of the result agrees."""
    import torch

    from pipeline.cast import ptq

    name = min((n for n, (s, linear) in inventory.items() if linear and s[0] == s[1]),
               key=lambda n: inventory[n][0][0])
    w = reader.get(f"{name}.weight").float()
    h = hessians[w.shape[1]] if algorithm == "gptq" else None
    runs = {}
    for key, where in (("cpu", torch.device("cpu")), ("device", device)):
        t0 = time.perf_counter()
        packed, master = ptq.cast(fmt, w.to(where), algorithm=algorithm,
                                  fitted={k: v.to(where) for k, v in states[name].items()},
                                  hessian=None if h is None else h.to(where))
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        runs[key] = ({k: v.cpu() for k, v in packed.items()}, master.cpu(), time.perf_counter() - t0)
    (p_cpu, m_cpu, t_cpu), (p_dev, m_dev, t_dev) = runs["cpu"], runs["device"]
    hd = (h if h is not None else torch.eye(w.shape[1])).double().cpu()

    def output_error(p):
        e = (w - fmt.unpack(p, tuple(w.shape))).double()
        return float(((e @ hd) * e).sum() / ((w.double() @ hd) * w.double()).sum())

    return {"matrix": name, "shape": list(w.shape), "threads": torch.get_num_threads(),
            "cpu_seconds": round(t_cpu, 3), "device_seconds": round(t_dev, 3),
            "packed_bytes_equal": float((p_cpu["packed"] == p_dev["packed"]).float().mean()),
            "scales_equal": float((p_cpu["scale"] == p_dev["scale"]).float().mean()),
            "tables_equal": bool(torch.equal(p_cpu["table"], p_dev["table"])),
            "masters_equal": float((m_cpu == m_dev).float().mean()),
            "relative_output_error_cpu": output_error(p_cpu), "relative_output_error_device": output_error(p_dev)}
