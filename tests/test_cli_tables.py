"""Every CLI table read at 80 columns: no line longer than 80, no cell cut (no ellipsis, no
number or device name broken), and every device name still there and distinct.

Each command runs twice, at COLUMNS=80 and at COLUMNS=1000; a token of the narrow output
that holds a digit or a '/' (numbers with units, device and link names) must be a token of the
wide output — a number folded mid-digit or a name cut to 'v100/gp' would not be.
"""

from __future__ import annotations

import json
import re

import pytest
from rich.cells import cell_len
from typer.testing import CliRunner

from heterog.cli.main import app
from heterog.cli.output import print_table, set_wide
from heterog.fmt import human_bytes
from heterog.hardware.spec import load_cluster

BOX = re.compile(r"[│┃┏┓┗┛┣┫┡┩┠┨━─┳┻╇╈┯┷┼╋└┘┌┐├┤┬┴╀╁]")


def _tokens(text: str) -> set[str]:
    """The words in the tables' rows (lines outside tables hold timings that vary run to run)."""
    return {w for line in text.splitlines() if "│" in line or "┃" in line for w in BOX.sub(" ", line).split()}


def _run(args: list[str], columns: int) -> str:
    res = CliRunner().invoke(app, args, env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    return res.stdout


def _check(args: list[str], devices: tuple[str, ...] = ()) -> str:
    narrow, wide = _run(args, 80), _run(args, 1000)
    long = [line for line in narrow.splitlines() if cell_len(line) > 80]
    assert not long, f"{args}: {len(long)} line(s) over 80 columns, e.g. {long[0]!r}"
    assert not [w for w in _tokens(narrow) if "…" in w], f"{args}: a cell was cut:\n{narrow}"
    ref = _tokens(wide)
    broken = sorted(t for t in _tokens(narrow) - ref if re.search(r"[\d/]", t))
    assert not broken, f"{args}: cut or folded: {broken}\n{narrow}"
    shown_wide = {d for d in devices if d in ref}
    shown = {d for d in devices if d in _tokens(narrow)}
    assert shown == shown_wide, f"{args}: device names lost at 80 columns: {sorted(shown_wide - shown)}"
    return narrow


@pytest.mark.parametrize(
    "args",
    [
        ["models"],
        ["gpus"],
        ["clusters"],
        ["predict", "--model", "mlp", "--batch-size", "8", "--device", "V100-16GB"],
        ["capture", "--model", "mlp", "--batch-size", "8"],
    ],
)
def test_catalog_tables_fit_80_columns(args):
    _check(args)


def test_plan_and_simulate_tables_fit_80_columns(tmp_path):
    clu = load_cluster("mixed-16")
    names = tuple(d.name for d in clu.devices)
    plan = tmp_path / "plan.json"
    _check(
        [
            "plan",
            "--model",
            "mlp",
            "--batch-size",
            "64",
            "--cluster",
            "mixed-16",
            "--budget-s",
            "120",  # a safety stop: --max-iters ends the search, so both runs find the same plan
            "--max-iters",
            "20",
            "--no-gnn",
            "--out",
            str(plan),
        ],
        names,
    )
    out = _check(["simulate", str(plan)], names)
    sim = json.loads(_run(["simulate", str(plan), "--json"], 1000))
    assert sim["devices"]
    for device, row in sim["devices"].items():  # each device's peak memory and capacity, on its row
        line = next(x for x in out.splitlines() if f" {device} " in x)
        assert human_bytes(row["peak_memory_bytes"]) in line, (device, line)
        assert human_bytes(row["memory_capacity_bytes"]) in line, (device, line)
    notes = [x for x in out.splitlines() if x.startswith("(not shown:")]
    # a left-out column is named, with the way to see it; the memory is never left out
    assert all("memory" not in x and x.endswith("--wide shows every column)") for x in notes), notes


def test_print_table_never_cuts_and_names_what_it_leaves_out(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    devices = [f"node-{i:02d}/gpu{i % 8}" for i in range(6)]
    rows = [
        [
            d,
            f"{123456.789 * (i + 1):,.2f} ms",
            f"{i * 1.5:.2f} GiB",
            f"{d}.up→n05/gpu{i}",
            f"{i * 1e6:,.0f} B/s",
            f"{i * 7}% busy",
        ]
        for i, d in enumerate(devices)
    ]
    cols = ["device", "step time", "peak memory", "link", "rank", "busy"]
    set_wide(False)
    print_table("t", cols, rows, optional=("busy", "rank"))
    out = capsys.readouterr().out
    assert all(cell_len(line) <= 80 for line in out.splitlines())
    for r in rows:
        for cell in (r[0], r[1], r[2], r[3]):
            assert cell in out, cell  # whole, on one line
    assert "(not shown: busy, rank; --wide shows every column)" in out  # in the order given
    set_wide(True)
    try:
        print_table("t", cols, rows, optional=("busy", "rank"))
    finally:
        set_wide(False)
    wide = capsys.readouterr().out
    assert "not shown" not in wide and max(cell_len(line) for line in wide.splitlines()) > 80


@pytest.mark.slow
def test_run_tables_fit_80_columns(tmp_path):
    clu = load_cluster("emulated-4")
    names = tuple(d.name for d in clu.devices)
    plan = tmp_path / "plan.json"
    _run(
        [
            "plan",
            "--model",
            "mlp",
            "--batch-size",
            "32",
            "--cluster",
            "emulated-4",
            "--budget-s",
            "1",
            "--max-iters",
            "10",
            "--no-gnn",
            "--out",
            str(plan),
        ],
        80,
    )
    narrow = _run(["run", str(plan), "--steps", "2", "--no-shaping"], 80)
    assert all(cell_len(line) <= 80 for line in narrow.splitlines()), narrow
    assert not [w for w in _tokens(narrow) if "…" in w], narrow
    assert re.search(r"step 2/2 +loss [\d.]+ +step [\d.]+ \S+ +slowest rank \d", narrow), narrow
    for d in names:
        if d in _tokens(narrow):
            assert re.search(rf"\b{re.escape(d)}\b", narrow)
