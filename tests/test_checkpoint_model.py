"""A checkpoint names its model as a plan does: a copied project resumes, an edited model file
is named as the reason it does not, and a checkpoint of another model is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from heterog.errors import CheckpointError
from heterog.execute.checkpoint import check_same_model, model_key

MODEL_FILE = "import torch\n\ndef net():\n    return torch.nn.Linear(4, 2)\n"


def test_a_copied_model_file_matches_and_an_edited_one_is_named(tmp_path: Path) -> None:
    first = tmp_path / "a" / "net.py"
    first.parent.mkdir()
    first.write_text(MODEL_FILE)
    saved = model_key(f"{first}:net")
    assert str(tmp_path) not in saved  # nothing about where the project was

    copy = tmp_path / "b" / "net.py"
    copy.parent.mkdir()
    shutil.copy(first, copy)
    check_same_model(saved, f"{copy}:net", "ckpt")  # the same file elsewhere resumes

    copy.write_text(MODEL_FILE.replace("(4, 2)", "(4, 3)"))
    with pytest.raises(CheckpointError, match="model file changed since the checkpoint"):
        check_same_model(saved, f"{copy}:net", "ckpt")
    with pytest.raises(CheckpointError, match="is of model 'net.py:net"):
        check_same_model(saved, "toy-cnn", "ckpt")
    with pytest.raises(CheckpointError, match="is of model 'toy-cnn'"):
        check_same_model("toy-cnn", f"{first}:net", "ckpt")


def test_a_checkpoint_that_named_the_absolute_path_still_resumes_there(tmp_path: Path) -> None:
    path = tmp_path / "net.py"
    path.write_text(MODEL_FILE)
    check_same_model(f"{path.resolve()}:net", f"{path}:net", "ckpt")
    check_same_model("toy-cnn", "toy-cnn", "ckpt")
