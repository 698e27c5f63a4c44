"""Where heterog keeps what it can always compute again (measured CPU rates, captured graphs).

$HETEROG_CACHE_DIR when set; else $XDG_CACHE_HOME/heterog; else ~/.cache/heterog, the XDG
Base Directory specification's default for user caches
(specifications.freedesktop.org/basedir-spec). Deleting the folder is always safe.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HETEROG_CACHE_DIR"


def cache_dir() -> Path:
    """The user's heterog cache folder (not created here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "heterog"
