"""GPU types from their public figures (hardware/public_model.py), the catalog's sources, and
precisions as each card runs them (cost/precision.py). Accuracy against measurements is
benchmarks/predict_gpu.py --leave-one-type-out's job."""

from __future__ import annotations

import pytest

from heterog.cost.precision import precision_advice
from heterog.hardware import catalog
from heterog.hardware.catalog import get_gpu, list_gpus
from heterog.hardware.efficiency import gpu_curve
from heterog.hardware.public_model import packaged_public_model
from heterog.hardware.spec import load_cluster


def _entries() -> dict[str, dict]:
    return {e["name"]: e for e in catalog.catalog_document()["gpus"]}


def test_a_type_without_measurements_is_derived_not_given_a_measured_types_efficiency():
    """Every catalog type with no `efficiency` of its own gets the public-figure derivation,
    names it as its source, inherits from no sibling, and matches no measured type's fitted
    figures (the T4 once took the RTX 2080 Ti's, ×0.6)."""
    entries = _entries()
    measured = {n: get_gpu(n).efficiency for n, e in entries.items() if e.get("efficiency")}
    derived = [n for n, e in entries.items() if not e.get("efficiency")]
    assert {"T4", "L4", "L40S", "P100", "A10", "H100-SXM", "B200", "MI300X"} <= set(derived)
    model = packaged_public_model()
    for name in derived:
        eff = get_gpu(name).efficiency
        assert eff == model.efficiency(get_gpu(name)), name
        assert not eff.inherits and "public figures" in eff.source, name
        for sibling, fitted in measured.items():
            assert eff.compute != fitted.compute, (name, sibling)


def test_every_catalog_figure_names_its_source():
    doc = catalog.catalog_document()
    for e in doc["gpus"]:
        for figure in ("peak_tflops", "memory", "intra_node_link", "public"):
            assert str(e["sources"].get(figure, "")).strip(), (e["name"], figure)
        if e.get("efficiency"):
            assert "fitted" in e["efficiency"]["source"] or "measured" in e["efficiency"]["source"], e["name"]
    for vendor, h in doc["host_costs"].items():
        assert h["source"].strip(), vendor
    assert doc["public_model"]["source"].strip()
    for g in list_gpus():
        assert g.public is not None and g.efficiency.source.strip(), g.name


def test_a_power_capped_card_is_derived_at_its_public_benchmark():
    """The T4's derived fp16 GEMM rate at n = 4096 against the public figure it was not fitted
    on: ~24 TF in cuBLAS under its 70 W cap (NVIDIA developer forum, 'About GPU peak
    performance'). Within 15 %; the boost-clock peak (65 TF) would be 2.7x off."""
    t4 = get_gpu("T4")
    rate = t4.peak_flops_per_s["fp16"] * float(gpu_curve(t4, "fp16").at(4096)) * t4.efficiency.compute["fp16"]
    assert rate == pytest.approx(24e12, rel=0.15)


def test_sustained_clock_and_feed_rules():
    """Power-capped cards sustain a smaller share of their peak than full-power ones, a
    GeForce card's half-rate tensor units a larger share than full-rate ones, and no derived
    plateau passes the peak."""
    model = packaged_public_model()
    plateau = {n: model.plateau(get_gpu(n), "fp16") for n in ("T4", "L4", "V100-32GB", "H100-SXM", "RTX-4090")}
    assert plateau["T4"] < 0.5 * plateau["V100-32GB"] and plateau["L4"] < 0.6 * plateau["H100-SXM"]
    assert plateau["RTX-4090"] > plateau["H100-SXM"]
    assert all(0 < p <= 1 for p in plateau.values())
    # a vendor that publishes no base clock: the stated default fraction of its boost
    assert model.clock_fraction(get_gpu("MI300X").public) == model.default_base_fraction


def test_a_precision_some_devices_do_not_run_fast_is_said_and_a_better_one_suggested():
    """amp-bf16 on paper-8gpu (V100, P100, GTX 1080 Ti: no bf16 path) is costed at their fp32
    rate, and fp16 (tensor cores on the V100, paired fp16 on the P100) is suggested."""
    advice = precision_advice(load_cluster("paper-8gpu"), "amp-bf16")
    assert advice.suggested == "fp16"
    assert {t.gpu_type for t in advice.types if not t.accelerated} == {"V100-16GB", "P100", "GTX-1080Ti"}
    assert all(t.runs_as == "fp32" for t in advice.types)
    assert "no fast path on" in advice.notes[0] and "Use --precision fp16" in advice.notes[1]
    assert precision_advice(load_cluster("paper-8gpu"), "fp32").notes == ()
    assert precision_advice(load_cluster("mixed-64"), "amp-bf16").suggested is None  # a few V100s: not worth it


def test_the_cost_model_runs_an_unaccelerated_precision_at_the_fp32_rate():
    from cost_support import transformer_graph

    from heterog.cost.predict import predict

    g = transformer_graph(layers=1, hidden=1024, seq=256, batch=8)
    v100 = {p: predict(g, batch_size=8, device="V100-16GB", precision=p) for p in ("fp32", "amp-bf16", "fp16")}
    assert v100["amp-bf16"]["precision_runs_as"] == "fp32" and v100["amp-bf16"]["notes"]
    assert v100["fp16"]["iteration_time_s"] < 0.5 * v100["amp-bf16"]["iteration_time_s"]
    assert v100["amp-bf16"]["iteration_time_s"] > 0.8 * v100["fp32"]["iteration_time_s"]


def test_every_precision_option_lists_every_value_and_which_types_run_it():
    from typer.testing import CliRunner

    from heterog.cli.main import app

    for command in ("plan", "predict", "profile"):
        out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"}).output
        text = " ".join(out.split())
        assert "fp32 | tf32 | amp-bf16 | fp16" in text, command
        assert "amp-bf16 on all but P100, V100-16GB" in text and "fp16 on all but GTX-1080Ti" in text, command
