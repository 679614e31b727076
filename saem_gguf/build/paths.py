"""Where things live: the repository's patches/ and native/, and the build cache outside the tree."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCHES_DIR = REPO_ROOT / "patches"
NATIVE_DIR = REPO_ROOT / "native"
CMAKELISTS = REPO_ROOT / "CMakeLists.txt"


def cache_root() -> Path:
    """Build cache, outside the work tree so a fresh clone reuses it: $SAEM_GGUF_CACHE or ~/.cache."""
    env = os.environ.get("SAEM_GGUF_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "saem_gguf"
