"""Output files: checked before the work starts, written atomically.

Every command that writes a file (GGUF, trace, profile, JSON, plot) calls ``check_output_path``
while parsing its flags, so a directory, a missing parent, an unwritable place or a wrong extension
fails in a second, not after an hour of work. The write itself goes through ``atomic_output``: a
temporary file in the target directory, renamed into place when complete and removed on any
failure (exceptions, Ctrl-C, and SIGTERM/SIGHUP, which ``cli.main`` turns into exceptions), so a
reader never sees a half-written file. The temporary file is created with mode 0666 minus the
umask (0644 usually), the mode ``open()`` would give; not 0600 as ``tempfile.mkstemp`` would.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import IO, Iterator

from saem_gguf.errors import SaemError

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_output_path(path: str | os.PathLike, what: str = "output",
                      suffixes: tuple[str, ...] | None = None) -> Path:
    """``path`` if a file can be written there; else SaemError saying why. Creates nothing that
    stays: writability is tested with a probe file in the target directory (permissions alone do
    not tell, e.g. under /proc or on a read-only mount)."""
    p = Path(path)
    if str(path) == "" or p.name in ("", ".", ".."):
        raise SaemError(f"{what} {str(path)!r}: not a file name")
    if p.is_dir():
        raise SaemError(f"{what} {p}: is a directory")
    if suffixes is not None and p.suffix.lower() not in suffixes:
        raise SaemError(f"{what} {p}: the file name must end in {' or '.join(suffixes)}")
    parent = p.parent
    if not parent.exists():
        raise SaemError(f"{what} {p}: directory {parent} does not exist")
    if not parent.is_dir():
        raise SaemError(f"{what} {p}: {parent} is not a directory")
    if p.exists() and not p.is_file():
        raise SaemError(f"{what} {p}: exists and is not a regular file")
    probe = _temp_name(p)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as e:
        raise SaemError(f"{what} {p}: cannot write there ({e.strerror or e})") from None
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return p


def _temp_name(path: Path) -> Path:
    # hidden, unique, in the target directory (a rename within one file system is atomic);
    # the target's suffix stays last so tools that pick a format by extension still do
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial{path.suffix}")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block completes it is renamed to
    ``path``, and on any exception (KeyboardInterrupt and SystemExit included) it is removed."""
    path = Path(path)
    tmp = _temp_name(path)
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as e:
        raise SaemError(f"{path}: cannot write ({e.strerror or e})") from None
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """``open(path, mode)`` written atomically (see ``atomic_output``); text modes default to UTF-8."""
    binary = "b" in mode
    with atomic_output(path) as tmp:
        try:
            with open(tmp, mode, encoding=None if binary else encoding) as f:
                yield f
        except OSError as e:
            raise SaemError(f"{path}: cannot write ({e.strerror or e})") from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)
