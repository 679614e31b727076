"""Prompt sets for bench, trace and calibrate: a file (one prompt per line) or the built-in set."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from saem_gguf.errors import SaemError


def load_prompts(path: Path | None) -> list[str]:
    if path is None:
        text = resources.files("saem_gguf.data").joinpath("prompts/reasoning.txt").read_text()
        where = "built-in prompts"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise SaemError(f"cannot read prompts {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise SaemError(f"prompts {path} is not UTF-8 text") from None
        where = str(path)
    prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not prompts:
        raise SaemError(f"{where}: no prompts (one per line)")
    return prompts
