"""The embedded default model: a small reasoning MoE (qwen3moe) that ships inside the package.

``python -m saem_gguf chat`` and friends use it when no model is given, so the whole mechanism
(stage cues in generated reasoning, stage-aware expert placement) runs with no download. See
docs/DEFAULT_MODEL.md for how it was trained (``python -m saem_gguf.defaultmodel.train``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from saem_gguf.errors import SaemError

DEFAULT_MODEL_FILE = "default-model.gguf"
# its calibration (`calibrate --min-stage-tokens 12` on traces of 40 held-out questions; see
# docs/DEFAULT_MODEL.md): expert statistics for static-hot and the caches' priors, and the
# per-cue stage routing saem-cue ranks by
DEFAULT_PROFILE_FILE = "default-model.profile.json"


def default_model_path() -> Path:
    """Path of the packaged default model GGUF; SaemError if this installation lacks it."""
    path = Path(str(resources.files("saem_gguf.data").joinpath(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise SaemError(
            f"the embedded default model is missing ({path}); this installation of saem_gguf is "
            "incomplete: reinstall it, regenerate the file with `python -m saem_gguf.defaultmodel.train` "
            "(needs PyTorch), or pass a model path explicitly")
    return path


def default_profile_path() -> Path | None:
    """Path of the packaged default model's calibration profile, or None if it is missing."""
    path = Path(str(resources.files("saem_gguf.data").joinpath(DEFAULT_PROFILE_FILE)))
    return path if path.is_file() else None
