"""Per-layer times on seven GPU types (cost/data/peer_layers.json, from Sailor and the Aceso
profiler), each layer predicted as the layer that was measured (Megatron-LM's,
cost/peer_layer.py). Two ways of scoring, both on data the predicting figures never saw:

- **Leave one type out** (`leave_one_type_out`): a type predicted from its public figures
  alone (hardware/public_model.py), with the cross-type constants fitted on the other types'
  layers and the H200's matmul sweep — none of its own measurements, nor those of a type on
  the same die (A100 40/80 GB; GH200 and the H200). This is how every catalog type without
  measurements is costed.
- **Leave one model out within a type** (`per_type_leave_one_model_out`): the type's own
  figures (compute per precision, size scale, memory) fitted on two of its models' layers,
  the third predicted. This is how a measured type's catalog figures are made.

Sailor records compare forward + backward; Aceso's backward is input-gradient only, so
Aceso records compare the forward. Each Aceso op was timed alone by the host: no op of it
takes less than the harness's own per-op time, a floor fitted per type with its figures (a
property of how the data were measured, used to score, not shipped); a held-out type takes
the median floor of the training types.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from importlib import resources
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from heterog.cost.analytic import AnalyticCostModel
from heterog.cost.predict import _captured, single_device_cluster
from heterog.hardware.catalog import get_gpu
from heterog.hardware.efficiency import h200_plateau
from heterog.hardware.gputype import Efficiency, GpuType
from heterog.hardware.public_model import MODEL_FIELDS, PublicModel, derive, packaged_public_model
from heterog.ir.kinds import Phase

DEVICE = "local/gpu0"
PEER_TO_CATALOG = {
    "A100-40": "A100-40GB",
    "A100-80": "A100-80GB",
    "V100-16": "V100-16GB",
    "RTX-2080": "RTX-2080Ti",
    "RTX-3090": "RTX-3090",
    "Titan-RTX": "Titan-RTX",
    "GH-96": "GH200",
}
PEER_LAYER = str(Path(__file__).resolve().parent.parent / "src" / "heterog" / "cost" / "peer_layer.py")
# Types on one die: holding one out holds out the other's data too (the H200 enters the
# cross-type fit through its matmul sweep's plateaus)
SAME_DIE = (frozenset({"A100-40GB", "A100-80GB"}), frozenset({"GH200", "H200"}))
# The H200 sweep's plateau at bf16, tf32 and fp32 each weighs as much as this many layer
# records: the three together about as much as one type's ~25 layers
H200_SWEEP_WEIGHT = 8
H200_SWEEP_PRECISIONS = ("bf16", "tf32", "fp32")
# Types whose own layers cannot fit their figures (A100-80GB: two models, TF32 only, one
# source): the catalog derives them from their public figures; their score is leave-one-type-out
NOT_FITTED = frozenset({"A100-80GB"})
# (lower, start, upper) of each cross-type constant in the fit
MODEL_BOUNDS = {
    "tensor_efficiency": (0.2, 0.9, 1.5),
    "tensor_rate_exponent": (0.0, 0.2, 1.0),
    "simt_efficiency": (0.3, 0.9, 1.2),
    "memory_efficiency": (0.3, 0.8, 1.0),
}
FLOOR_BOUNDS_S = (1e-6, 8e-5, 3e-4)  # the Aceso floor: from above (a floor under every op has no gradient)


def layer_records() -> list[dict]:
    doc = json.loads(resources.files("heterog.cost").joinpath("data", "peer_layers.json").read_text())
    return [r for r in doc["layer_times"] if r["gpu"] in PEER_TO_CATALOG]


def records_by_type(records: list[dict]) -> dict[str, list[dict]]:
    return {name: [r for r in records if r["gpu"] == peer] for peer, name in PEER_TO_CATALOG.items()}


def layer_precision(r: dict) -> str:
    if r["dtype"] == "fp16":
        return "fp16"
    return "tf32" if str(r.get("math_mode_inferred") or "").startswith("tf32") else "fp32"


def layer_graph(r: dict):
    """A one-layer model of the record's shape, as the measured layer ran it, and the module
    prefix of its layer. GPT/OPT layers: Megatron-LM's layer (cost/peer_layer.py: unfused
    attention with dropout on the s×s probabilities, fused softmax and GELU), which is what
    Aceso's op table and Sailor's profiles time; the zoo's GPT-2 (fused SDPA attention, eager
    tanh-GELU) moves a different amount of memory. Llama (one GH200 record): the zoo's."""
    h, heads, seq = r["hidden"], r["heads"], r["seq_len"]
    if r["ffn_type"] == "swiglu":
        args = {
            "hidden": h,
            "layers": 1,
            "heads": heads,
            "kv_heads": 8,
            "ffn": r["ffn"],
            "vocab": 128,
            "positions": seq,
        }
        return _captured("llama", args, 1, seq), "model.layers.0"
    args = {
        "hidden": h,
        "heads": heads,
        "ffn": r["ffn"],
        "layers": 1,
        "positions": seq,
        "fused_softmax": r["dtype"] == "fp16",
    }
    return _captured(f"{PEER_LAYER}:megatron_gpt_layer", args, 1, seq), "layers.0"


def is_aceso(r: dict) -> bool:
    return r["source"].startswith("aceso")


def layer_times_s(records: list[dict], gpu: GpuType, aceso_op_floor_s: float = 0.0) -> np.ndarray:
    """Predicted time of each record's comparable quantity (see the module docstring). An
    Aceso record is a sum of ops each timed alone by the host over 40 repeats: no op of it
    takes less than the harness's own per-op time, `aceso_op_floor_s` (its layer norm takes
    ~70-80 µs on A100 at micro-batch 1 and 8 alike, where its bytes grow 8×)."""
    cluster = single_device_cluster(gpu)
    out = []
    models: dict[tuple, tuple] = {}
    for r in records:
        key = (r["hidden"], r["heads"], r["seq_len"], r["ffn_type"], layer_precision(r))
        if key not in models:
            g, prefix = layer_graph(r)
            names = [n.name for n in g.nodes if n.module_path.startswith(prefix + ".") or n.module_path == prefix]
            ops = np.array(["::" not in n for n in names])  # one profiled op per module
            models[key] = (AnalyticCostModel(g, cluster, precision=layer_precision(r), optimizer="adamw"), names, ops)
        m, names, ops = models[key]
        if is_aceso(r):
            ts = m.node_times_s(names, DEVICE, r["micro_batch"], Phase.FORWARD)
            out.append(float(np.where(ops, np.maximum(ts, aceso_op_floor_s), ts).sum()))
        else:
            out.append(
                m.group_time_s(names, DEVICE, r["micro_batch"], Phase.FORWARD)
                + m.group_time_s(names, DEVICE, r["micro_batch"], Phase.BACKWARD)
            )
    return np.array(out)


def layer_measured_s(r: dict) -> float:
    return (r["fwd_ms"] + (r["bwd_ms"] if r["source"].startswith("sailor") else 0.0)) * 1e-3


def _row(name: str, r: dict, predicted_s: float, **extra) -> dict:
    measured = layer_measured_s(r)
    return {
        "gpu": name,
        "peer_gpu": r["gpu"],
        "model": r["model"],
        "source": r["source"],
        "micro_batch": r["micro_batch"],
        "precision": layer_precision(r),
        "measured_s": measured,
        "predicted_s": float(predicted_s),
        "error": float(predicted_s / measured - 1),
        **extra,
    }


# -- leave one model out within a type: a measured type's own figures -----------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TypeFit:
    """A type's fitted figures (shipped in the catalog) and the Aceso harness's per-op floor
    on that type's machine (a property of how the data was measured: used to score, not
    shipped)."""

    efficiency: Efficiency
    aceso_op_floor_s: float


def fit_type(gpu: GpuType, records: list[dict]) -> TypeFit:
    """A type's compute factor per precision its records ran at, its size scale and memory
    factor, and the Aceso floor of its machine (when its records include Aceso's)."""
    precisions = sorted({layer_precision(r) for r in records})
    measured = np.array([layer_measured_s(r) for r in records])
    k = len(precisions)
    floor = any(is_aceso(r) for r in records)

    def fit_of(x) -> TypeFit:
        eff = Efficiency(
            compute=dict(zip(precisions, np.exp(x[:k]))),
            size_scale=float(np.exp(x[k])),
            memory=float(min(np.exp(x[k + 1]), 1.0)),
            source="predict_gpu.py fit",
        )
        return TypeFit(efficiency=eff, aceso_op_floor_s=float(np.exp(x[k + 2])) if floor else 0.0)

    def residuals(x):
        f = fit_of(x)
        return np.log(
            layer_times_s(records, dataclasses.replace(gpu, efficiency=f.efficiency), f.aceso_op_floor_s) / measured
        )

    lo_s, x0_s, hi_s = FLOOR_BOUNDS_S
    x0 = np.log([0.8] * k + [1.0, 0.7] + ([x0_s] if floor else []))
    lo = np.log([0.05] * k + [0.5, 0.1] + ([lo_s] if floor else []))
    hi = np.log([3.0] * k + [2.0, 1.0] + ([hi_s] if floor else []))
    res = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1, diff_step=1e-3, max_nfev=80)
    return fit_of(res.x)


def arch(r: dict) -> str:
    return r["model"].split("/", 1)[1]


def per_type_leave_one_model_out(records: list[dict]) -> dict:
    rows, fits = [], {}
    for name, recs in records_by_type(records).items():
        if name in NOT_FITTED:
            continue
        base = dataclasses.replace(get_gpu(name), efficiency=Efficiency())
        for held in sorted({arch(r) for r in recs}):
            train = [r for r in recs if arch(r) != held]
            test = [r for r in recs if arch(r) == held]
            if not train:
                continue
            fit = fit_type(base, train)
            fits[f"{name}/{held}"] = dataclasses.asdict(fit)
            pred = layer_times_s(test, dataclasses.replace(base, efficiency=fit.efficiency), fit.aceso_op_floor_s)
            unfitted = layer_times_s(test, base)
            rows += [
                _row(name, r, t, error_without_type_factors=float(u / layer_measured_s(r) - 1))
                for r, t, u in zip(test, pred, unfitted)
            ]
        print(f"  {name}: {sum(1 for r in rows if r['gpu'] == name)} held-out layer predictions", flush=True)
    return {"rows": rows, "fits": fits}


def fit_all_types(records: list[dict]) -> dict[str, dict]:
    """Each measured type's figures fitted on all of its layers (what the catalog ships)."""
    return {
        name: dataclasses.asdict(fit_type(dataclasses.replace(get_gpu(name), efficiency=Efficiency()), recs))
        for name, recs in records_by_type(records).items()
        if name not in NOT_FITTED
    }


# -- leave one type out: a type from its public figures ----------------------------------------


def die_mates(name: str) -> frozenset[str]:
    return next((d for d in SAME_DIE if name in d), frozenset({name}))


def fit_public_model(by_type: dict[str, list[dict]], with_h200: bool) -> tuple[PublicModel, dict[str, float]]:
    """The cross-type constants (hardware/public_model.py) that best predict the given types'
    layers from their public figures (and, with_h200, the H200 sweep's plateaus), with each
    type's Aceso floor fitted beside them."""
    names = list(MODEL_BOUNDS)
    floored = [n for n, rs in by_type.items() if any(is_aceso(r) for r in rs)]
    measured = {n: np.array([layer_measured_s(r) for r in rs]) for n, rs in by_type.items()}
    fixed = packaged_public_model()
    h200 = get_gpu("H200")

    def unpack(x) -> tuple[PublicModel, dict[str, float]]:
        model = dataclasses.replace(
            fixed, **dict(zip(names, (float(v) for v in x[: len(names)]))), source="predict_gpu_layers.py fit"
        )
        return model, dict(zip(floored, (float(v) for v in np.exp(x[len(names) :]))))

    def residuals(x):
        model, floors = unpack(x)
        out = [
            np.log(layer_times_s(rs, derive(get_gpu(n), model), floors.get(n, 0.0)) / measured[n])
            for n, rs in by_type.items()
        ]
        if with_h200:
            out += [
                np.full(H200_SWEEP_WEIGHT, math.log(model.plateau(h200, p) / h200_plateau(p)))
                for p in H200_SWEEP_PRECISIONS
            ]
        return np.concatenate(out)

    lo_s, x0_s, hi_s = FLOOR_BOUNDS_S
    x0 = [MODEL_BOUNDS[n][1] for n in names] + [math.log(x0_s)] * len(floored)
    lo = [MODEL_BOUNDS[n][0] for n in names] + [math.log(lo_s)] * len(floored)
    hi = [MODEL_BOUNDS[n][2] for n in names] + [math.log(hi_s)] * len(floored)
    res = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1, diff_step=1e-3, max_nfev=200)
    return unpack(res.x)


def leave_one_type_out(records: list[dict]) -> dict:
    """Each type predicted from its public figures, with the constants fitted on the other
    types (and the H200 sweep, unless the held-out type shares its die)."""
    by_type = records_by_type(records)
    rows, fits = [], {}
    for held, recs in by_type.items():
        mates = die_mates(held)
        train = {n: rs for n, rs in by_type.items() if n not in mates}
        model, floors = fit_public_model(train, with_h200="H200" not in mates)
        floor = statistics.median(floors.values()) if any(is_aceso(r) for r in recs) else 0.0
        pred = layer_times_s(recs, derive(get_gpu(held), model), floor)
        rows += [_row(held, r, t) for r, t in zip(recs, pred)]
        fits[held] = {
            "model": {f: getattr(model, f) for f in MODEL_FIELDS},
            "training_floors_s": floors,
            "held_out_floor_s": floor,
            "trained_on": sorted(train) + (["H200 sweep"] if "H200" not in mates else []),
        }
        errs = [abs(r["error"]) for r in rows if r["gpu"] == held]
        print(
            f"  {held}: {len(recs)} layers predicted from public figures, median |error| "
            f"{100 * statistics.median(errs):.1f} %",
            flush=True,
        )
    return {"rows": rows, "fits": fits}


def fit_public_model_all(records: list[dict]) -> dict:
    """The cross-type constants fitted on every type with data and the H200 sweep (what the
    catalog ships as `public_model`)."""
    model, floors = fit_public_model(records_by_type(records), with_h200=True)
    return {"model": {f: getattr(model, f) for f in MODEL_FIELDS}, "floors_s": floors}
