"""The pages say what is true: README.md and docs/ run as written, their tables are the result
files', and the repository speaks of itself alone.

Code blocks: every fenced block names its language. `python` blocks run (in-process, in a
fresh folder per page, blocks of a page in order), `sh` blocks run line by line (`heterog …`
lines through the CLI in-process, others in bash), `yaml` blocks holding `nodes:` load as
clusters, `text` blocks are not code. An HTML comment on the line before a block marks it:
`<!-- example: slow (why) -->` runs only in `make test-sweep`; `<!-- example: not run (why) -->`
never runs; `<!-- example: file NAME -->` also writes the block to NAME, for later blocks.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:^<!-- example: (?P<mark>[^>]*?) -->\n)?^```(?P<lang>[^\n`]*)\n(?P<body>.*?)^```$", re.S | re.M)
LANGUAGES = {"python", "sh", "yaml", "text"}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    mark: str
    body: str


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(
            page=page.name,
            line=text.count("\n", 0, m.start("body")),
            lang=m.group("lang").strip(),
            mark=(m.group("mark") or "").strip(),
            body=m.group("body"),
        )
        for m in FENCE.finditer(text)
    ]


def test_readme_is_a_short_guide_that_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; keep it a guide of at most 200 (detail in docs/)"
    head = "\n".join(lines[:20])
    assert "make demo" in head and "make test" in head


def test_every_code_block_names_its_language_and_any_mark_is_known():
    for page in PAGES:
        for b in blocks(page):
            where = f"{b.page}:{b.line}"
            assert b.lang in LANGUAGES, f"{where}: a block in {b.lang or 'no language'}; use one of {LANGUAGES}"
            assert not b.mark or re.fullmatch(r"(slow|not run) \(.+\)|file [\w./-]+", b.mark), (
                f"{where}: unknown mark {b.mark!r}"
            )


def test_tables_are_made_from_the_result_files():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tables.py"), "--check"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


# Built from pieces so that this file does not match itself.
OUTSIDE = [
    r"\.\./shared",
    r"\bshared/data\b",
    "/" + "work/",
    *(rf"\b{n}\.md\b" for n in ("DESIGN", "TOOLCHAIN", "REFERENCE", "STYLE")),
]
HISTORY = [
    r"\bround[ -]\d",
    r"_round\d",
    r"\b(this|last|previous|next|earlier) (round|session)s?\b",
    r"\b(these|our|the project's) sessions\b",
    r"\bthe session's\b",
    r"\brounds ago\b",
    r"\bissue \d+",
    r"\bthe issue.s\b",
]
DATED = [r"\b20\d\d-[01]\d-[0-3]\d\b", r"\b\d\d:\d\d(–\d\d:\d\d)? UTC\b"]


def _files() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml", *(ROOT / "docs").glob("*.md")]
    for folder, patterns in (("src", ("*.py", "*.yaml", "*.md")), ("tests", ("*.py",)), ("benchmarks", ("*.py",))):
        out += [p for pattern in patterns for p in (ROOT / folder).rglob(pattern) if ".egg-info" not in str(p)]
    return out


def test_the_repository_speaks_of_itself_alone():
    """No pointers to files outside it; no words about how or when its code was written
    (history is git's and CHANGELOG.md's); no dated runs in the pages."""
    found = []
    for path in _files():
        rules = OUTSIDE + HISTORY + (DATED if path.suffix == ".md" else [])
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for r in rules if re.search(r, line, re.I)]
    assert not found, "\n".join(found)


def test_no_merge_conflict_is_left_in_the_text():
    marker = re.compile(r"^(<{7}|>{7}) ")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in [*_files(), ROOT / "CHANGELOG.md"]
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if marker.match(line)
    ]
    assert not found, f"conflict markers at {found}"


def _run_sh(line: str, folder: Path, where: str) -> None:
    args = shlex.split(line, comments=True)
    if not args:
        return
    if args[0] == "heterog" and not set(args) & {">", "|", "&&", ";", "<"}:
        from heterog.cli.main import run_cli

        assert run_cli(args[1:]) == 0, f"{where}: {line}"
        return
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # this heterog first
    out = subprocess.run(
        ["bash", "-c", line], cwd=folder, capture_output=True, text=True, timeout=300, env={**os.environ, "PATH": path}
    )
    assert out.returncode == 0, f"{where}: {line}\n{out.stdout[-2000:]}{out.stderr[-2000:]}"


def _run(block: Block, folder: Path) -> None:
    where = f"{block.page}:{block.line}"
    if block.mark.startswith("file "):
        (folder / block.mark[5:]).write_text(block.body)
    if block.lang == "python":
        code = compile(block.body, where, "exec")
        exec(code, {"__name__": "__main__"})  # noqa: S102 - the page's own example
    elif block.lang == "sh":
        for line in block.body.replace("\\\n", " ").splitlines():
            _run_sh(line, folder, where)
    elif block.lang == "yaml" and "nodes:" in block.body:
        from heterog.hardware.spec import parse_cluster_yaml

        parse_cluster_yaml(block.body, where)


def _page_ids() -> list:
    out = []
    for page in PAGES:
        if any(b.lang in ("python", "sh", "yaml") and not b.mark.startswith("not run") for b in blocks(page)):
            out.append(pytest.param(page, False, id=page.name))
            if any(b.mark.startswith("slow") for b in blocks(page)):
                out.append(pytest.param(page, True, id=f"{page.name}-slow", marks=pytest.mark.sweep))
    return out


@pytest.mark.parametrize(("page", "slow"), _page_ids())
def test_the_pages_examples_run(page: Path, slow: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The page's blocks in order, in a fresh folder; slow ones only in the sweep."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HETEROG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    ran = 0
    for block in blocks(page):
        if block.mark.startswith("not run") or (block.mark.startswith("slow") and not slow):
            continue
        _run(block, tmp_path)
        ran += 1
    assert ran


def test_a_not_run_mark_says_why():
    for page in PAGES:
        for b in blocks(page):
            if b.mark.startswith(("not run", "slow")):
                assert len(b.mark) > len("not run ()") + 8, f"{b.page}:{b.line}: say why the block is not run"
    assert os.path.isfile(ROOT / "benchmarks" / "tables.py")
