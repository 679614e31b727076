"""llama-cli's /read and /glob in `chat` (saem_gguf.chat_files): the glob matcher against a line-
by-line transcription of llama.cpp's recursive glob_match on random patterns, the files a pattern
picks, and the commands in a chat session on the embedded model (/read, /glob, /regen, /clear)."""

from __future__ import annotations

import io
import random

import pytest

from saem_gguf.chat_files import GLOB_MAX_FILES, glob_files, glob_match


def naive_class(c: str, p: str, end: int, i: int) -> bool:
    """llama.cpp's glob_class_match(c, pattern + i, pattern + end)."""
    negated = False
    if i < end and p[i] == "!":
        negated, i = True, i + 1
    if i < end and p[i] in "]-":
        if p[i] == c:
            return not negated
        i += 1
    matched = False
    while i < end:
        if i + 2 < end and p[i + 1] == "-" and p[i + 2] != "]":
            if p[i] <= c <= p[i + 2]:
                matched = True
                break
            i += 3
        else:
            if p[i] == c:
                matched = True
                break
            i += 1
    return not matched if negated else matched


def naive_glob(p: str, s: str, i: int = 0, j: int = 0) -> bool:
    """llama.cpp's recursive glob_match (common/common.cpp), with indices for pointers."""
    if i == len(p):
        return j == len(s)
    if p.startswith("**", i):
        if naive_glob(p, s, i + 2, j):
            return True
        return j < len(s) and naive_glob(p, s, i, j + 1)
    if p[i] == "*":
        while j < len(s) and s[j] != "/":
            if naive_glob(p, s, i + 1, j):
                return True
            j += 1
        return naive_glob(p, s, i + 1, j)
    if p[i] == "?" and j < len(s) and s[j] != "/":
        return naive_glob(p, s, i + 1, j + 1)
    if p[i] == "[":
        end = i + 1
        if end < len(p) and p[end] in "]-":
            end += 1
        while end < len(p) and p[end] != "]":
            end += 1
        if end < len(p):
            if j == len(s):
                return False
            return naive_class(s[j], p, end, i + 1) and naive_glob(p, s, end + 1, j + 1)
        return j < len(s) and s[j] == "[" and naive_glob(p, s, i + 1, j + 1)
    return j < len(s) and p[i] == s[j] and naive_glob(p, s, i + 1, j + 1)


def test_glob_match_is_llama_cpps_on_random_patterns():
    rng = random.Random(5)
    pattern_chars, path_chars = "ab/*?[]!-", "ab/[]-!"
    n = 0
    for _ in range(20000):
        p = "".join(rng.choice(pattern_chars) for _ in range(rng.randint(0, 7)))
        s = "".join(rng.choice(path_chars) for _ in range(rng.randint(0, 7)))
        assert glob_match(p, s) == naive_glob(p, s), (p, s)
        n += glob_match(p, s)
    assert n > 300  # the random cases are not all misses (711 match)


@pytest.mark.parametrize("pattern,path,match", [
    ("*.py", "a.py", True), ("*.py", "d/a.py", False), ("**.py", "d/e/a.py", True), ("**/*.py", "d/a.py", True),
    ("?", "/", False), ("[a-c]x", "bx", True), ("[!a-c]x", "bx", False), ("[]]", "]", True), ("[-a]", "-", True),
    ("[ab", "[ab", True), ("a" * 3000, "a" * 3000, True),  # no recursion limit
])
def test_glob_match_examples(pattern, path, match):
    assert glob_match(pattern, path) is match


def test_glob_files_take_the_leading_path_as_the_directory(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    for name in ("a.txt", "b.md", "d/c.txt", "d/e/f.txt"):
        (tmp_path / name).write_text(name)
    names = lambda found: [p.relative_to(tmp_path).as_posix() for p in found]  # noqa: E731
    assert names(glob_files("*.txt", tmp_path)) == ["a.txt"]
    assert names(glob_files("**.txt", tmp_path)) == ["a.txt", "d/c.txt", "d/e/f.txt"]
    assert names(glob_files("d/*.txt", tmp_path)) == ["d/c.txt"]  # matched from d/
    assert names(glob_files("d/e/f.txt", tmp_path)) == ["d/e/f.txt"]  # no wildcard: the whole path
    assert glob_files("nowhere/*", tmp_path) == []
    for i in range(GLOB_MAX_FILES + 5):
        (tmp_path / f"many{i:03d}.log").write_text("x")
    assert len(glob_files("*.log", tmp_path)) == GLOB_MAX_FILES + 1  # one more says: the limit


def test_chat_commands_read_glob_regen_and_clear(tmp_path, monkeypatch):
    from saem_gguf.chat import ChatSession
    from saem_gguf.default_model import default_model_path
    from saem_gguf.engine import Engine, EngineConfig

    (tmp_path / "note.txt").write_text("12 + 7\n")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe")
    monkeypatch.chdir(tmp_path)
    notes: list[str] = []
    eng = Engine(EngineConfig(model=default_model_path(), n_ctx=2048, n_threads=2, seed=0))
    try:
        out = io.StringIO()
        s = ChatSession(eng, n_predict=24, out=out, notify=notes.append)
        s.handle("/read note.txt")
        s.handle("/read missing.txt")
        s.handle("/read bin.dat")
        assert notes == ["error: file does not exist or cannot be opened: 'missing.txt'",
                         "error: file is not UTF-8 text: 'bin.dat'"]
        s.handle("What is that?")
        assert s.messages[0] == {"role": "user", "content": "--- File: note.txt ---\n12 + 7\nWhat is that?"}
        first = s.messages[-1]["content"]
        s.handle("/regen")  # greedy: the same answer again, in place of the first
        assert len(s.messages) == 2 and s.messages[-1]["content"] == first
        s.handle("/glob *.txt")
        s.handle("and this?")
        assert s.messages[2]["content"] == "--- File: " + str(tmp_path / "note.txt") + " ---\n12 + 7\nand this?"
        s.handle("/clear")
        assert s.messages == [] and s.pending == ""
        s.handle("/regen")
        assert notes[-1] == "error: no message to regenerate"
        assert "[loaded text from 'note.txt']" in out.getvalue() and "[new conversation]" in out.getvalue()
    finally:
        eng.close()
