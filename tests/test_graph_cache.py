"""The on-disk cache of captured graphs (capture/cache.py), the torch-free zoo table, and the
small things users meet first: file permissions and "did you mean"."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from heterog.capture import cache
from heterog.capture.cache import capture_cached, entry_path, graph_key


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HETEROG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HETEROG_GRAPH_CACHE", raising=False)
    monkeypatch.delenv("HETEROG_GRAPH_CACHE_MIB", raising=False)
    return tmp_path / "cache"


def test_a_hit_is_the_graph_a_capture_gives(cache_dir: Path):
    from heterog.capture import capture_model

    first = capture_cached("mlp", {"hidden": 24}, batch_size=8)
    again = capture_cached("mlp", {"hidden": 24}, batch_size=8)
    fresh = capture_model("mlp", {"hidden": 24}, batch_size=8)
    assert first.meta["graph_cache"] == "miss" and again.meta["graph_cache"] == "hit"
    assert again.to_dict(include_meta=False) == fresh.to_dict(include_meta=False)
    assert again.fingerprint() == fresh.fingerprint()
    assert entry_path("graph", graph_key("mlp", {"hidden": 24}, 8, None)).parent == cache_dir / "captures"


def test_the_key_follows_everything_that_shapes_the_graph(tmp_path: Path, cache_dir: Path):
    keys = {
        graph_key("mlp", None, 8, None),
        graph_key("mlp", None, 16, None),
        graph_key("mlp", {"hidden": 8}, 8, None),
        graph_key("gpt2", None, 8, 64),
        graph_key("gpt2", None, 8, 128),
    }
    assert len(keys) == 5
    model = tmp_path / "net.py"
    model.write_text("def net(): ...\n")
    before = graph_key(f"{model}:net", None, 8, None)
    (tmp_path / "helper.py").write_text("X = 1\n")  # a file beside it that it may import
    beside = graph_key(f"{model}:net", None, 8, None)
    model.write_text("def net(): return None\n")
    assert len({before, beside, graph_key(f"{model}:net", None, 8, None)}) == 3


def test_a_damaged_entry_is_captured_again_and_repaired(cache_dir: Path):
    capture_cached("mlp", batch_size=4)
    path = entry_path("graph", graph_key("mlp", None, 4, None))
    path.write_text(path.read_text()[:100])
    again = capture_cached("mlp", batch_size=4)
    assert again.meta["graph_cache"] == "miss"
    assert capture_cached("mlp", batch_size=4).meta["graph_cache"] == "hit"


def test_the_store_is_bounded_least_recently_used_first(cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    capture_cached("mlp", batch_size=2)
    size = entry_path("graph", graph_key("mlp", None, 2, None)).stat().st_size
    monkeypatch.setenv("HETEROG_GRAPH_CACHE_MIB", str(2.5 * size / 2**20))
    capture_cached("mlp", batch_size=3)
    os.utime(entry_path("graph", graph_key("mlp", None, 3, None)), (1, 1))  # long unused
    capture_cached("mlp", batch_size=2)  # a hit: most recent
    capture_cached("mlp", batch_size=5)  # a third entry: one must go
    left = {b for b in (2, 3, 5) if entry_path("graph", graph_key("mlp", None, b, None)).exists()}
    assert left == {2, 5}


def test_concurrent_commands_share_one_entry(cache_dir: Path):
    code = (
        "from heterog.capture.cache import capture_cached; "
        "g = capture_cached('mlp', {'layers': 4}, batch_size=6); print(g.fingerprint())"
    )
    env = {**os.environ, "HETEROG_CACHE_DIR": str(cache_dir)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    prints = {p.communicate(timeout=240)[0].strip() for p in procs}
    assert len(prints) == 1 and all(p.returncode == 0 for p in procs)
    assert capture_cached("mlp", {"layers": 4}, batch_size=6).meta["graph_cache"] == "hit"
    assert not list((cache_dir / "captures").glob(".*.tmp"))  # no temporary file left behind


def test_a_cached_graph_and_the_zoo_list_need_no_torch(cache_dir: Path):
    capture_cached("mlp", batch_size=7)
    code = textwrap.dedent("""
        import sys
        from heterog.capture.cache import capture_cached
        assert capture_cached('mlp', batch_size=7).meta['graph_cache'] == 'hit'
        from heterog.cli.main import run_cli
        assert run_cli(['models']) == 0
        assert 'torch' not in sys.modules, 'torch imported'
        print('ok')
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HETEROG_CACHE_DIR": str(cache_dir)},
    )
    assert out.stdout.strip().endswith("ok"), out.stderr


def test_the_zoo_table_matches_the_zoo():
    from heterog.capture.models import MODEL_INFO
    from heterog.capture.zoo import ZOO

    assert list(MODEL_INFO) == list(ZOO)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mlp", "toy-cnn", "resnet50", "gpt2", "bert-large"])
def test_the_zoo_tables_parameter_counts_are_the_models(name: str):
    import torch

    from heterog.capture import count_parameters
    from heterog.capture.models import MODEL_INFO
    from heterog.capture.zoo import get_zoo_model

    with torch.device("meta"):
        assert count_parameters(get_zoo_model(name).build()) == MODEL_INFO[name].num_parameters


def test_written_files_follow_the_umask(tmp_path: Path):
    from heterog.jsonio import write_atomic

    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a.json", "{}")
        os.umask(0o077)
        write_atomic(tmp_path / "b.json", "{}")
        os.chmod(tmp_path / "a.json", 0o640)
        write_atomic(tmp_path / "a.json", "[]")  # an existing file keeps its mode
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "b.json").stat().st_mode) == 0o600
    write_atomic(tmp_path / "c.json", "{}")
    assert stat.S_IMODE((tmp_path / "c.json").stat().st_mode) == 0o666 & ~old


@pytest.mark.parametrize(
    ("args", "suggestion"),
    [
        (["capture", "--model", "resnet5", "--batch-size", "2"], "Did you mean 'resnet50'"),
        (["plan", "--model", "mlp", "--batch-size", "8", "--cluster", "paper-8gpus"], "Did you mean 'paper-8gpu'"),
    ],
)
def test_unknown_names_get_a_suggestion(args: list[str], suggestion: str, capsys: pytest.CaptureFixture):
    from heterog.cli.main import run_cli

    assert run_cli(args) == 2
    assert suggestion in capsys.readouterr().err


def test_the_cache_can_be_turned_off(cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HETEROG_GRAPH_CACHE", "0")
    g = capture_cached("mlp", batch_size=9)
    assert "graph_cache" not in g.meta and not (cache_dir / "captures").exists()
    assert not cache.enabled()
