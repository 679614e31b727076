"""How a streamed chat answer is printed: thinking dimmed or folded, stage marks before their cue.

``AnswerPrinter`` receives the answer's text as it is decoded and the stage events as the detector
reports them. A cue's event fires after its last token (or the token after it, for cues that need
a right boundary), when the cue's first characters have been decoded already; so the printer holds
back the last few characters (the longest cue, plus one piece) and inserts the mark where the cue
begins. An event without a cue (a routing shift) is marked where it fired.

``<think>…</think>`` is shown dimmed (ANSI, only when ``styled``: a terminal without ``NO_COLOR``),
or, with ``hide_thinking``, folded into one line that says how much was hidden.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TextIO

DIM, RESET = "\x1b[2m", "\x1b[0m"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PIECE_SLACK = 16  # characters of the one piece that may follow a cue before its event fires


def use_style(out: TextIO) -> bool:
    """ANSI styling only on a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    return out.isatty() and not os.environ.get("NO_COLOR")


@dataclass
class _Mark:
    label: str


@dataclass
class AnswerPrinter:
    out: TextIO
    styled: bool
    hide_thinking: bool = False
    hold_chars: int = 0  # characters held back so that a stage mark can go before its cue
    _pending: list = field(default_factory=list)  # str (text) and _Mark, in output order
    _carry: str = ""  # a tag's first characters, waiting for the rest
    _in_think: bool = False
    _hidden_chars: int = 0
    _hidden_marks: int = 0

    # --- input -------------------------------------------------------------------------------
    def feed(self, text: str) -> None:
        if text:
            self._pending.append(text)
        self._emit(self._pending_chars() - self.hold_chars)

    def stage_mark(self, source: str, cue: str) -> None:
        """A stage boundary: before the last occurrence of ``cue`` still held back, else here."""
        mark = _Mark(f"⟦{source}: {cue or 'routing shift'}⟧")
        text = "".join(s for s in self._pending if isinstance(s, str))
        at = text.casefold().rfind(cue.casefold()) if cue else -1
        self._insert(mark, at if at >= 0 else len(text))

    def finish(self) -> None:
        """The answer ended: print what is held back and close an open thinking block."""
        self._emit(self._pending_chars())
        self._body(self._carry)
        self._carry = ""
        if self._in_think and self.hide_thinking:
            self._write(self._fold_end())
        elif self._in_think and self.styled:
            self._write(RESET)
        self._in_think = False

    # --- holding back ------------------------------------------------------------------------
    def _pending_chars(self) -> int:
        return sum(len(s) for s in self._pending if isinstance(s, str))

    def _insert(self, mark: _Mark, at: int) -> None:
        """Put ``mark`` before text character ``at`` of the pending text."""
        out, seen, placed = [], 0, False
        for seg in self._pending:
            if not placed and isinstance(seg, str) and seen + len(seg) > at:
                cut = at - seen
                out += [x for x in (seg[:cut], mark, seg[cut:]) if x != ""]
                placed = True
            else:
                out.append(seg)
            if isinstance(seg, str):
                seen += len(seg)
        if not placed:
            out.append(mark)
        self._pending = out

    def _emit(self, n_chars: int) -> None:
        """Print the first ``n_chars`` pending text characters and the marks among them."""
        while self._pending and (n_chars > 0 or isinstance(self._pending[0], _Mark)):
            seg = self._pending.pop(0)
            if isinstance(seg, _Mark):
                self._mark(seg)
                continue
            if len(seg) > n_chars:
                self._pending.insert(0, seg[n_chars:])
                seg = seg[:n_chars]
            n_chars -= len(seg)
            self._text(seg)

    # --- rendering ---------------------------------------------------------------------------
    def _text(self, s: str) -> None:
        s, self._carry = self._carry + s, ""
        while s:
            tag = THINK_CLOSE if self._in_think else THINK_OPEN
            i = s.find(tag)
            if i < 0:
                # a tag may be split between pieces: keep its first characters for the next call
                k = next((k for k in range(min(len(tag) - 1, len(s)), 0, -1) if tag.startswith(s[-k:])), 0)
                self._body(s[:len(s) - k])
                self._carry = s[len(s) - k:]
                return
            self._body(s[:i])
            self._tag(tag)
            s = s[i + len(tag):]

    def _tag(self, tag: str) -> None:
        opening = tag == THINK_OPEN
        if self.hide_thinking:
            if opening:
                self._hidden_chars = self._hidden_marks = 0
                self._write("[thinking…")
            else:
                self._write(self._fold_end())
        elif self.styled:
            self._write(DIM + tag if opening else tag + RESET)
        else:
            self._write(tag)
        self._in_think = opening

    def _fold_end(self) -> str:
        marks = f", {self._hidden_marks} stage marks" if self._hidden_marks else ""
        return f" {self._hidden_chars} characters hidden{marks}]"

    def _body(self, s: str) -> None:
        if not s:
            return
        if self._in_think and self.hide_thinking:
            self._hidden_chars += len(s)
            return
        self._write(s)

    def _mark(self, m: _Mark) -> None:
        if self._in_think and self.hide_thinking:
            self._hidden_marks += 1
        elif self.styled and not self._in_think:
            self._write(DIM + m.label + RESET)
        else:
            self._write(m.label)  # inside dimmed thinking it is dim already

    def _write(self, s: str) -> None:
        self.out.write(s)
        self.out.flush()
