"""Cue sets: the lexical stage-transition markers the matcher looks for, loaded from JSON.

A cue file (``saem_gguf/data/cues/*.json``) looks like::

    {
      "format": "saem-cues", "version": 1,
      "name": "qwen3",
      "description": "...",
      "extends": ["general"],               # optional: cue sets merged first (same directory)
      "remove": ["Hmm"],                    # optional: inherited cues to drop
      "defaults": {"boundary": "punct", "right_boundary": true},
      "cues": [
        "Alternatively",                    # a bare string takes the defaults
        {"text": "</think>", "boundary": "any", "kind": "end_think"}
      ]
    }

Matching is case-insensitive, so cues that differ only in case are the same cue (a later
definition replaces an earlier one, which is how a family file overrides ``general``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from saem_gguf.errors import SaemError

CUE_FORMAT = "saem-cues"
CUE_FORMAT_VERSION = 1
# Left-context rules, from strictest to loosest; a cue counts only where the text before it
# allows (see docs/STAGES.md, "Word-boundary rule").
BOUNDARY_MODES: tuple[str, ...] = ("line", "sentence", "punct", "word", "any")
DEFAULT_BOUNDARY = "punct"
# The matcher keeps a ring of left contexts this long (bytes) per sequence.
MAX_CUE_BYTES = 96


@dataclass(frozen=True)
class Cue:
    text: str
    # Where the cue may start: "line" (line start), "sentence" (+ after . ! ?), "punct"
    # (+ after , ; : and dashes), "word" (any word start), "any" (anywhere, even mid-word).
    boundary: str = DEFAULT_BOUNDARY
    # Require a non-word character after the cue ("Wait" must not match "Waiting"). Only
    # meaningful when the cue ends in a letter or digit.
    right_boundary: bool = True
    kind: str = "transition"  # free label: alternative, verify, conclude, pause, end_think...

    def key(self) -> str:
        return self.text.casefold()


def _cue_from_obj(obj, defaults: dict, where: str) -> Cue:
    if isinstance(obj, str):
        obj = {"text": obj}
    if not isinstance(obj, dict):
        raise SaemError(f"{where}: a cue must be a string or an object, got {type(obj).__name__}")
    unknown = set(obj) - {"text", "boundary", "right_boundary", "kind"}
    if unknown:
        raise SaemError(f"{where}: unknown cue field(s) {sorted(unknown)}")
    merged = {**defaults, **obj}
    text = merged.get("text")
    if not isinstance(text, str) or not text:
        raise SaemError(f"{where}: cue text must be a non-empty string")
    if text != text.strip():
        raise SaemError(f"{where}: cue {text!r} has leading/trailing whitespace (context is set by 'boundary')")
    try:
        nbytes = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise SaemError(f"{where}: cue {text!r} is not encodable as UTF-8") from e
    if nbytes > MAX_CUE_BYTES:
        raise SaemError(f"{where}: cue {text[:20]!r}... is {nbytes} bytes, at most {MAX_CUE_BYTES}")
    boundary = merged.get("boundary", DEFAULT_BOUNDARY)
    if boundary not in BOUNDARY_MODES:
        raise SaemError(f"{where}: cue {text!r}: boundary must be one of {BOUNDARY_MODES}, got {boundary!r}")
    right = merged.get("right_boundary", True)
    if not isinstance(right, bool):
        raise SaemError(f"{where}: cue {text!r}: right_boundary must be true or false")
    kind = merged.get("kind", "transition")
    if not isinstance(kind, str):
        raise SaemError(f"{where}: cue {text!r}: kind must be a string")
    return Cue(text=text, boundary=boundary, right_boundary=right, kind=kind)


@dataclass
class CueSet:
    """An ordered set of cues; a cue's id is its index here."""

    name: str = "custom"
    cues: list[Cue] = field(default_factory=list)
    description: str = ""

    def __post_init__(self) -> None:
        self.cues = _dedupe(self.cues)

    def __len__(self) -> int:
        return len(self.cues)

    def __iter__(self) -> Iterator[Cue]:
        return iter(self.cues)

    def __getitem__(self, i: int) -> Cue:
        return self.cues[i]

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.cues]

    def index(self, text: str) -> int:
        k = text.casefold()
        for i, c in enumerate(self.cues):
            if c.key() == k:
                return i
        raise KeyError(text)

    def subset(self, texts: Iterable[str], name: str | None = None) -> CueSet:
        keys = {t.casefold() for t in texts}
        return CueSet(name or self.name, [c for c in self.cues if c.key() in keys], self.description)

    def merged(self, other: CueSet, name: str | None = None) -> CueSet:
        return CueSet(name or self.name, list(self.cues) + list(other.cues), self.description)

    @classmethod
    def from_texts(cls, texts: Iterable[str], name: str = "custom", **cue_fields) -> CueSet:
        return cls(name, [_cue_from_obj({"text": t, **cue_fields}, {}, name) for t in texts])

    # ---- JSON

    def to_dict(self) -> dict:
        return {
            "format": CUE_FORMAT,
            "version": CUE_FORMAT_VERSION,
            "name": self.name,
            "description": self.description,
            "cues": [
                {"text": c.text, "boundary": c.boundary, "right_boundary": c.right_boundary, "kind": c.kind}
                for c in self.cues
            ],
        }

    @classmethod
    def from_dict(cls, d: dict, *, base_dir: Path | None = None, where: str = "cue set", allow_empty: bool = False,
                  _seen=()) -> CueSet:
        if not isinstance(d, dict):
            raise SaemError(f"{where}: expected a JSON object")
        if d.get("format", CUE_FORMAT) != CUE_FORMAT:
            raise SaemError(f"{where}: format must be {CUE_FORMAT!r}, got {d.get('format')!r}")
        ver = d.get("version", CUE_FORMAT_VERSION)
        if ver != CUE_FORMAT_VERSION:
            raise SaemError(f"{where}: unsupported cue file version {ver!r} (this build reads {CUE_FORMAT_VERSION})")
        unknown = set(d) - {"format", "version", "name", "description", "extends", "remove", "defaults", "cues"}
        if unknown:
            raise SaemError(f"{where}: unknown field(s) {sorted(unknown)}")
        name = d.get("name", "custom")
        if not isinstance(name, str):
            raise SaemError(f"{where}: name must be a string")
        defaults = d.get("defaults", {})
        if not isinstance(defaults, dict) or set(defaults) - {"boundary", "right_boundary", "kind"}:
            raise SaemError(f"{where}: defaults may only set boundary, right_boundary, kind")
        cues: list[Cue] = []
        extends = d.get("extends", [])
        if isinstance(extends, str):
            extends = [extends]
        if not isinstance(extends, list) or not all(isinstance(x, str) for x in extends):
            raise SaemError(f"{where}: extends must be a list of cue set names")
        for parent in extends:
            if parent in _seen:
                raise SaemError(f"{where}: cyclic 'extends' through {parent!r}")
            cues.extend(_load_named(parent, base_dir, (*_seen, name)).cues)
        remove = d.get("remove", [])
        if not isinstance(remove, list) or not all(isinstance(x, str) for x in remove):
            raise SaemError(f"{where}: remove must be a list of cue texts")
        drop = {x.casefold() for x in remove}
        cues = [c for c in cues if c.key() not in drop]
        raw = d.get("cues", [])
        if not isinstance(raw, list):
            raise SaemError(f"{where}: cues must be a list")
        for i, obj in enumerate(raw):
            cues.append(_cue_from_obj(obj, defaults, f"{where}: cues[{i}]"))
        if not cues and not allow_empty:
            raise SaemError(f"{where}: the cue set is empty")
        return cls(name, cues, d.get("description", ""))

    @classmethod
    def load(cls, spec: str | Path) -> CueSet:
        """Load a cue file by path, or a built-in set by name ("general", "qwen3", ...)."""
        p = Path(spec)
        if p.suffix == ".json" or p.exists():
            return _load_path(p, ())
        return _load_named(str(spec), None, ())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _dedupe(cues: list[Cue]) -> list[Cue]:
    # Later definitions win (a family file overrides general), keeping the first position.
    pos: dict[str, int] = {}
    out: list[Cue] = []
    for c in cues:
        if not isinstance(c, Cue):
            raise SaemError(f"expected Cue, got {type(c).__name__}")
        k = c.key()
        if k in pos:
            out[pos[k]] = c
        else:
            pos[k] = len(out)
            out.append(c)
    return out


def _load_path(p: Path, seen: tuple) -> CueSet:
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise SaemError(f"cannot read cue file {p}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise SaemError(f"cue file {p} is not UTF-8") from e
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise SaemError(f"cue file {p} is not valid JSON: {e.msg} (line {e.lineno})") from e
    return CueSet.from_dict(d, base_dir=p.parent, where=str(p), _seen=seen)


def builtin_cue_dir() -> Path:
    return Path(str(resources.files("saem_gguf") / "data" / "cues"))


def builtin_cue_sets() -> list[str]:
    return sorted(p.stem for p in builtin_cue_dir().glob("*.json"))


def _load_named(name: str, base_dir: Path | None, seen: tuple) -> CueSet:
    for d in ([base_dir] if base_dir else []) + [builtin_cue_dir()]:
        p = d / f"{name}.json"
        if p.exists():
            return _load_path(p, seen)
    raise SaemError(f"unknown cue set {name!r}; built-in sets: {', '.join(builtin_cue_sets())}")


def load_cues(spec: str | Path | CueSet) -> CueSet:
    return spec if isinstance(spec, CueSet) else CueSet.load(spec)


def with_boundary(cues: CueSet, boundary: str) -> CueSet:
    """The same cues with one boundary mode for all (e.g. for tests and ablations)."""
    if boundary not in BOUNDARY_MODES:
        raise SaemError(f"boundary must be one of {BOUNDARY_MODES}")
    return CueSet(cues.name, [replace(c, boundary=boundary) for c in cues], cues.description)
