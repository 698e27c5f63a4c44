"""The layering docs/architecture.md states holds: import-linter's contracts (pyproject.toml)
pass, the page lists exactly the contracts' layers, imports inside functions say why they are
there, and the entry points that promise to start light do."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from importlinter import cli

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "heterog"


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_import_contracts_hold(capsys, tmp_path):
    code = cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), cache_dir=str(tmp_path), no_logo=True)
    out = capsys.readouterr().out
    assert code == 0, out[out.find("Broken contracts") :] or out


def test_the_architecture_page_states_the_layers_of_the_contract():
    """docs/architecture.md's layer list is the layers contract, line for line."""
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page[page.index("\n## Layers\n") :]
    block = section[section.index("```text\n") + len("```text\n") :].split("```", 1)[0]
    stated = [line.strip().removeprefix("heterog.") for line in block.strip().splitlines()]
    assert stated == [layer.replace("heterog.", "") for layer in layers]


def _function_imports_without_reason() -> list[str]:
    """Imports inside functions that have neither a comment on their line nor one on the line
    above their run of imports. `try: import x / except ImportError` (an optional dependency)
    says why by its form."""
    missing: set[str] = set()
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for block in ast.walk(fn):
                for field in ("body", "orelse", "finalbody"):
                    stmts = getattr(block, field, None)
                    if not isinstance(stmts, list) or (isinstance(block, ast.Try) and field == "body"):
                        continue
                    run_start = None
                    for st in stmts:
                        if not isinstance(st, (ast.Import, ast.ImportFrom)):
                            run_start = None
                            continue
                        run_start = run_start or st.lineno
                        above = lines[run_start - 2].strip() if run_start > 1 else ""
                        if "#" not in lines[st.lineno - 1] and not above.startswith("#"):
                            missing.add(f"{path.relative_to(ROOT)}:{st.lineno}: {ast.unparse(st)}")
    return sorted(missing)


def test_imports_inside_functions_say_why():
    missing = _function_imports_without_reason()
    assert not missing, "imports belong at the module top, or say why not in a comment:\n" + "\n".join(missing)


def test_the_command_line_and_the_planning_api_start_without_torch():
    """What the comments on lazy imports promise: `heterog --help` loads neither numpy nor
    torch, and the lower/simulate/plan-input API (heterog.orchestrate, heterog.inputs) no torch."""
    code = (
        "import sys\n"
        "import heterog.cli.main\n"
        "print(sorted(m for m in ('numpy', 'torch', 'scipy') if m in sys.modules))\n"
        "import heterog.orchestrate, heterog.inputs\n"
        "print(sorted(m for m in ('torch', 'torch_geometric', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout
