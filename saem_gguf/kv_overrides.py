"""llama.cpp's ``--override-kv KEY=TYPE:VALUE,...``: model metadata set at load, over the file's.

Read as llama.cpp's ``string_parse_kv_override`` reads it (types ``int``, ``float``, ``bool``,
``str``; comma-separated items, a CSV row; keys under 128 bytes, strings under 128), stricter where
it is silent: ``int:12x`` or ``float:abc`` (its ``atol``/``atof`` read 12 and 0) and a key given
twice (its loader keeps the first) are refused. The values go to llama-cpp-python's ``Llama(
kv_overrides=...)`` as Python ``int``/``float``/``bool``/``str``, which it passes to llama.cpp
tagged so.

llama.cpp applies an override only where its tag is the type it reads the key as (an integer
for a ``uint32`` key), and ignores it with a warning otherwise; here that is an error naming the
type to give. The overridden values are checked before the load as the file's are
(model_check): ``qwen3moe.expert_used_count=int:0`` would abort llama.cpp.
"""

from __future__ import annotations

import csv
import math
import re

from saem_gguf.errors import SaemError

MAX_KEY_BYTES = 127  # llama_model_kv_override.key is char[128]
MAX_STR_BYTES = 127  # .val_str is char[128], NUL-terminated
_INT = re.compile(r"[+-]?\d+")

KvOverrides = tuple[tuple[str, "bool | int | float | str"], ...]


def parse_kv_overrides(text: str) -> KvOverrides:
    """``KEY=TYPE:VALUE`` items, comma-separated; a SaemError names the first bad one."""
    items = next(csv.reader([text], skipinitialspace=False), [])
    out: list[tuple[str, bool | int | float | str]] = []
    for item in items:
        key, sep, typed = item.partition("=")
        if not sep or not key:
            raise SaemError(f"malformed KV override {item!r}: expected KEY=TYPE:VALUE (int, float, bool, str)")
        if len(key.encode()) > MAX_KEY_BYTES:
            raise SaemError(f"KV override key {key[:40]!r}... is longer than {MAX_KEY_BYTES} bytes")
        kind, colon, value = typed.partition(":")
        if not colon or kind not in ("int", "float", "bool", "str"):
            raise SaemError(f"invalid type for KV override {item!r}: expected int:, float:, bool: or str:")
        out.append((key, _value(item, kind, value)))
    return tuple(out)


def _value(item: str, kind: str, value: str) -> bool | int | float | str:
    if kind == "int":
        if not _INT.fullmatch(value) or not -2**63 <= int(value) < 2**63:
            raise SaemError(f"KV override {item!r}: not a 64-bit integer")
        return int(value)
    if kind == "float":
        try:
            v = float(value)
        except ValueError:
            v = math.nan
        if not math.isfinite(v):
            raise SaemError(f"KV override {item!r}: not a finite number")
        return v
    if kind == "bool":
        if value not in ("true", "false"):
            raise SaemError(f"invalid boolean value for KV override {item!r}: true or false")
        return value == "true"
    if len(value.encode()) > MAX_STR_BYTES:
        raise SaemError(f"KV override {item[:40]!r}...: the value cannot exceed {MAX_STR_BYTES} bytes")
    return value


def merged(overrides: KvOverrides) -> dict[str, bool | int | float | str]:
    """The overrides as llama-cpp-python takes them; a key given twice is a SaemError."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in overrides:
        if key in out:
            raise SaemError(f"--override-kv gives {key} twice")
        out[key] = value
    return out
