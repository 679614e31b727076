"""llama-cli's file commands for ``chat``: ``/read FILE`` and ``/glob PATTERN`` put text files into
the next message, each as ``--- File: NAME ---`` and a newline before its text, the message typed
after them following the last file's text as it is (llama.cpp ``tools/cli/cli-context.cpp``).

``/glob`` matches as llama.cpp's ``glob_match`` (``common/common.cpp``): ``*`` and ``?`` stop at a
``/``, ``**`` crosses it, ``[...]`` is a class of characters and ranges (``[!...]`` negated; a ``]``
or ``-`` first is literal; a ``[`` never closed is literal), everything else matches itself. The
pattern is matched against each file's path relative to the directory its leading path names
(the part before its first wildcard, ``~`` the home directory), else the current one; at most
``GLOB_MAX_FILES`` files. Unlike llama-cli the files are taken in sorted order (its order is the
filesystem's), and a file that is not UTF-8 text is refused with one line (the message must be
text).
"""

from __future__ import annotations

import os
from pathlib import Path

GLOB_MAX_FILES = 100  # llama-cli's FILE_GLOB_MAX_RESULTS
WILDCARDS = "![*?"  # where llama-cli's pattern stops being a path


def file_block(path: Path, shown: str) -> str:
    """The text a file adds to the message; OSError or UnicodeDecodeError when it cannot be read
    as UTF-8 text."""
    return f"--- File: {shown} ---\n" + path.read_bytes().decode("utf-8")


def _class_match(c: str, cls: str) -> bool:
    """Whether ``c`` is in the class ``cls`` (the text between ``[`` and ``]``)."""
    i, negated = 0, False
    if cls[:1] == "!":
        negated, i = True, 1
    if i < len(cls) and cls[i] in "]-":  # literal when first
        if cls[i] == c:
            return not negated
        i += 1
    matched = False
    while i < len(cls):
        if i + 2 < len(cls) and cls[i + 1] == "-" and cls[i + 2] != "]":
            if cls[i] <= c <= cls[i + 2]:
                matched = True
                break
            i += 3
        else:
            if cls[i] == c:
                matched = True
                break
            i += 1
    return matched != negated


def _tokens(pattern: str) -> list[tuple[str, str]]:
    """``pattern`` as (kind, text) items: ``**``, ``*``, ``?``, ``class`` (its text) or ``char``."""
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            out.append(("**", ""))
            i += 2
        elif ch in "*?":
            out.append((ch, ""))
            i += 1
        elif ch == "[":
            end = i + 1
            if end < len(pattern) and pattern[end] in "]-":
                end += 1
            end = pattern.find("]", end)
            if end < 0:  # never closed: a literal [
                out.append(("char", "["))
                i += 1
            else:
                out.append(("class", pattern[i + 1:end]))
                i = end + 1
        else:
            out.append(("char", ch))
            i += 1
    return out


def glob_match(pattern: str, path: str) -> bool:
    """llama.cpp's glob_match(pattern, path), as a table over (pattern item, path position)
    instead of its recursion (a long path would exhaust Python's)."""
    items = _tokens(pattern)
    n = len(path)
    # ok[j]: the items from the current one on match path[j:]; filled from the last item back
    ok = [False] * n + [True]
    for kind, text in reversed(items):
        nxt, ok = ok, [False] * (n + 1)
        for j in range(n, -1, -1):
            if kind == "**":
                ok[j] = nxt[j] or (j < n and ok[j + 1])
            elif kind == "*":  # any run of non-/ characters, the / itself not included
                ok[j] = nxt[j] or (j < n and path[j] != "/" and ok[j + 1])
            elif j == n:
                ok[j] = False
            elif kind == "?":
                ok[j] = path[j] != "/" and nxt[j + 1]
            elif kind == "class":
                ok[j] = _class_match(path[j], text) and nxt[j + 1]
            else:
                ok[j] = path[j] == text and nxt[j + 1]
    return ok[0]


def glob_files(pattern: str, cwd: Path) -> list[Path]:
    """The files ``/glob pattern`` reads, sorted, at most GLOB_MAX_FILES + 1 (one more tells the
    caller the limit was reached)."""
    base = cwd
    start = next((i for i, ch in enumerate(pattern) if ch in WILDCARDS), -1)
    if start > 0:
        cut = pattern.rfind("/", 0, start)
        if cut >= 0:
            lead = pattern[:cut]
            if lead.startswith("~") and os.environ.get("HOME"):
                lead = os.environ["HOME"] + lead[1:]
            base = cwd / lead
            pattern = pattern[cut + 1:]
    found: list[Path] = []
    for root, dirs, files in os.walk(base):
        dirs.sort()
        for name in sorted(files):
            full = Path(root) / name
            if full.is_file() and glob_match(pattern, full.relative_to(base).as_posix()):
                found.append(full)
                if len(found) > GLOB_MAX_FILES:
                    return found
    return found
