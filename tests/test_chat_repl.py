"""The chat REPL as a terminal user meets it: readline editing and history, thinking dimmed or
folded, stage marks before their cue; piped stdin stays one turn per line. The terminal path runs
the real command in a pseudo-terminal on the embedded model (which thinks in <think>…</think>)."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from conftest import REPO
from saem_gguf.chat_display import DIM, RESET, AnswerPrinter

QUESTION = "What is 47 + 38?"
REPLY_TOKENS = "800"  # room for the embedded model's whole reply to QUESTION
CUE_MARK = re.compile(r"⟦cue: ([^⟧]+)⟧\1")  # a stage mark right before the cue it names


def printed(pieces: list, styled: bool = False, hide: bool = False, hold: int = 0) -> str:
    """Feed ``pieces`` (text, or ("mark", cue) for a stage event) to a printer; what it printed."""
    out = io.StringIO()
    p = AnswerPrinter(out, styled=styled, hide_thinking=hide, hold_chars=hold)
    for x in pieces:
        if isinstance(x, tuple):
            p.stage_mark("cue", x[1])
        else:
            p.feed(x)
    p.finish()
    return out.getvalue()


# --- the printer ---------------------------------------------------------------------------------

def test_mark_goes_before_the_cue_that_opened_the_stage():
    # the detector fires on the piece after "verify" (right boundary): the mark still precedes "Let"
    s = printed(["So 85. ", "Let", " me", " verify", " by", ("mark", "Let me verify"), " subtracting."],
                hold=len("Let me verify") + 16)
    assert s == "So 85. ⟦cue: Let me verify⟧Let me verify by subtracting."


def test_mark_without_hold_back_or_cue_is_placed_where_it_fired():
    assert printed(["abc", ("mark", "Wait"), "def"]) == "abc⟦cue: Wait⟧def"
    assert printed(["abc", ("mark", ""), "def"]) == "abc⟦cue: routing shift⟧def"


def test_thinking_dimmed_only_when_styled_and_tags_split_across_pieces():
    pieces = ["<thi", "nk>", "\nhmm", "</th", "ink>", "\nAnswer"]
    assert printed(pieces, styled=True) == f"{DIM}<think>\nhmm</think>{RESET}\nAnswer"
    assert printed(pieces, styled=False) == "<think>\nhmm</think>\nAnswer"


def test_hide_thinking_folds_it_into_one_line():
    s = printed(["<think>", "one two", ("mark", "two"), " three", "</think>", "\n42"], hide=True, hold=20)
    assert s == "[thinking… 13 characters hidden, 1 stage marks]\n42"
    # an answer cut off while thinking still closes the line
    assert printed(["<think>abc"], hide=True) == "[thinking… 3 characters hidden]"


def test_text_that_only_looks_like_a_tag_is_printed():
    assert printed(["a <b> c <", "thin", "g"]) == "a <b> c <thing"


# --- piped stdin ---------------------------------------------------------------------------------

def _chat_piped(*argv: str, stdin: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "saem_gguf", "chat", "--hw", "rtx4090-ddr5", *argv],
                          input=stdin, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)


def test_piped_chat_places_marks_before_cues_without_styling(llama_cpp):
    r = _chat_piped("--show-stages", "-n", REPLY_TOKENS, stdin=f"{QUESTION}\n/stats\n")
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout
    assert CUE_MARK.search(r.stdout), r.stdout
    assert "<think>" in r.stdout and "</think>" in r.stdout
    assert "policy saem" in r.stdout and "hit rate" in r.stdout  # /stats unchanged


def test_piped_chat_one_turn_per_line_and_hidden_thinking(llama_cpp):
    r = _chat_piped("--hide-thinking", "-n", REPLY_TOKENS, stdin=f"{QUESTION}\nWhat is 9 + 4?\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("[thinking… ") == 2 and "<think>" not in r.stdout


def test_first_message_and_single_turn_as_llama_cli(llama_cpp, tmp_path):
    """llama-cli's -p / -f (the first user message, sent before any input is read, its escapes
    processed) and -st (the chat ends after one answer; with -p no input is read): -p's answer is
    the answer to the same message typed, and a command does not use up the single turn."""
    typed = _chat_piped("--hide-thinking", "-n", REPLY_TOKENS, stdin="What is 9 + 4?\n")
    assert typed.returncode == 0, typed.stderr
    r = _chat_piped("--hide-thinking", "-n", REPLY_TOKENS, "-p", "What is 9 + 4?", "-st", stdin=f"{QUESTION}\n")
    assert r.returncode == 0 and r.stdout == typed.stdout, (r.stdout, r.stderr)
    both = _chat_piped("--hide-thinking", "-n", REPLY_TOKENS, "-p", "What is 9 + 4?", stdin=f"{QUESTION}\n")
    assert both.stdout.startswith(typed.stdout) and both.stdout.count("[thinking… ") == 2
    f = tmp_path / "first.txt"
    f.write_text("What is 9 +\\x20 4?\n")  # "What is 9 +\x20 4?": \x20 is a space once escapes are processed
    from_file = _chat_piped("--hide-thinking", "-n", REPLY_TOKENS, "-f", str(f), "-st", stdin="")
    assert from_file.returncode == 0
    spaced = _chat_piped("--hide-thinking", "-n", REPLY_TOKENS, "-st", stdin="What is 9 +  4?\nWhat is 1 + 1?\n")
    assert from_file.stdout == spaced.stdout and spaced.stdout.count("[thinking… ") == 1
    listed = tmp_path / "notes.txt"
    listed.write_text("9 + 4 = 13\n")
    read = _chat_piped("--hide-thinking", "-n", REPLY_TOKENS, "-st", stdin=f"/read {listed}\nWhat is 9 + 4?\n")
    assert "[loaded text from" in read.stdout and read.stdout.count("[thinking… ") == 1, read.stdout


def test_color_flag_as_llama_cli(llama_cpp):
    """-co/--color on|off|auto (llama-cli's words): on dims the thinking even when piped."""
    on = _chat_piped("-co", "on", "-n", "12", "-p", QUESTION, "-st", stdin="")
    assert on.returncode == 0 and f"{DIM}<think>" in on.stdout, on.stdout
    off = _chat_piped("--color", "false", "-n", "12", "-p", QUESTION, "-st", stdin="")
    assert off.returncode == 0 and "\x1b[" not in off.stdout and off.stdout == on.stdout.replace(DIM, "").replace(RESET, "")
    bad = _chat_piped("--color", "maybe", stdin="")
    assert bad.returncode == 2 and "--color: expected on, off or auto" in bad.stderr and "Traceback" not in bad.stderr


def test_piped_chat_with_a_reasoning_budget_cuts_every_turns_thinking(llama_cpp):
    """--reasoning-budget 5 (llama-cli's): each turn's thinking is cut after 5 tokens by a forced
    </think> (the same cut as the stock server's: tests/test_serve_reference.py)."""
    r = _chat_piped("--reasoning-budget", "5", "-n", "80", stdin="What is 12 + 7?\nWhat is 9 + 4?\n")
    assert r.returncode == 0, r.stderr
    assert "<think>\nFirst, this is</think>" in r.stdout and r.stdout.count("</think>") == 2, r.stdout
    bad = _chat_piped("--reasoning-budget", "-2", stdin="")
    assert bad.returncode == 2 and "--reasoning-budget: must be >= -1" in bad.stderr and "Traceback" not in bad.stderr


# --- a terminal ----------------------------------------------------------------------------------

class Terminal:
    """The chat command on a pseudo-terminal (stdin, stdout and stderr are the tty)."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become the command
            os.chdir(REPO)
            os.execve(sys.executable, [sys.executable, "-m", "saem_gguf", "chat", *argv], env)
        self.out = b""

    def read_until(self, count_prompts: int, timeout: float = 120) -> None:
        """Read until the output holds ``count_prompts`` prompts ("> " at a line start)."""
        deadline = time.monotonic() + timeout
        while len(re.findall(rb"(?:^|\n)(?:\x1b\[[0-9;?]*[a-zA-Z])*> ", self.out)) < count_prompts:
            if time.monotonic() > deadline:
                raise AssertionError(f"no prompt #{count_prompts}: {self.out[-2000:]!r}")
            if select.select([self.fd], [], [], 0.5)[0]:
                try:
                    self.out += os.read(self.fd, 65536)
                except OSError:
                    break

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def close(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    self.out += os.read(self.fd, 65536)
                except OSError:
                    pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)
        raise AssertionError("the chat did not exit")


@pytest.fixture
def terminal_env(tmp_path, llama_cpp) -> dict:
    """A separate cache dir (so the history file is the test's), the built library forced."""
    from saem_gguf.llama_lib import resolve_library_dir

    env = dict(os.environ, SAEM_GGUF_CACHE=str(tmp_path), SAEM_GGUF_LIB_DIR=str(resolve_library_dir()),
               TERM="xterm", PYTHONPATH=os.environ.get("PYTHONPATH", str(REPO)))
    env.pop("NO_COLOR", None)
    return env


def test_terminal_dims_thinking_and_recalls_history(terminal_env, tmp_path):
    history = tmp_path / "chat_history"
    history.write_text("".join(f"old line {i}\n" for i in range(1500)))  # longer than the bound
    term = Terminal(["--show-stages", "-n", REPLY_TOKENS, "--hw", "rtx4090-ddr5"], terminal_env)
    term.read_until(1)
    term.send(QUESTION + "\r")
    term.read_until(2)
    first = term.out
    # up arrow recalls the question: it is asked again, and answered the same
    term.send("\x1b[A\r")
    term.read_until(3)
    term.send("/quit\r")
    assert term.close() == 0
    text = term.out.decode("utf-8", errors="replace")
    assert f"{DIM}<think>".encode() in first and f"</think>{RESET}".encode() in first
    assert CUE_MARK.search(text), text[-3000:]  # inside the dimmed thinking: no codes of its own
    assert text.count("Answer: 85") == 2, text[-3000:]
    lines = history.read_text().splitlines()
    # the recalled question is not stored twice in a row (Python's readline skips a repeat)
    assert lines[-2:] == [QUESTION, "/quit"] and lines.count(QUESTION) == 1
    assert len(lines) <= 1000 and "old line 1499" in lines


def test_terminal_without_color_and_with_hidden_thinking(terminal_env):
    term = Terminal(["--hide-thinking", "-n", REPLY_TOKENS, "--hw", "rtx4090-ddr5"], dict(terminal_env, NO_COLOR="1"))
    term.read_until(1)
    term.send(QUESTION + "\r")
    term.read_until(2)
    term.send("\x04")  # Ctrl-D ends the chat
    assert term.close() == 0
    text = term.out.decode("utf-8", errors="replace")
    assert "[thinking… " in text and "<think>" not in text and "Answer: 85" in text
    assert DIM not in text


TIMINGS_LINE = re.compile(r"^\[ Prompt: \d+\.\d t/s \| Generation: \d+\.\d t/s \]$", re.M)


def test_timings_after_each_answer_as_llama_cli(llama_cpp):
    """llama-cli's --show-timings (on by default): after each answer a line of prompt and
    generation speed, here on stderr (stdout holds the conversation); --no-show-timings: none."""
    r = _chat_piped("-n", "8", stdin=f"{QUESTION}\nWhat is 9 + 4?\n/stats\n")
    assert r.returncode == 0 and len(TIMINGS_LINE.findall(r.stderr)) == 2, r.stderr
    assert not TIMINGS_LINE.search(r.stdout)
    quiet = _chat_piped("-n", "8", "--no-show-timings", stdin=f"{QUESTION}\nWhat is 9 + 4?\n")
    assert quiet.returncode == 0 and not TIMINGS_LINE.search(quiet.stderr) and quiet.stdout == r.stdout.split("policy")[0]


def test_a_turns_prompt_rate_counts_only_the_tokens_decoded(llama_cpp):
    """The prompt rate is over the tokens decoded for the turn: a prefix kept from the turn before
    (chat reuses it) is not counted, as llama-server's prompt_n."""
    from saem_gguf.default_model import default_model_path
    from saem_gguf.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model=default_model_path(), n_ctx=512, n_threads=2, seed=0, progress=False))
    try:
        first = eng.prompt_tokens("Q: What is 2 + 2?\nA:")
        steps = eng.stream(first, 4, reuse_prefix=True)
        drawn = [t for t, _ in steps if t is not None]
        assert steps.prompt_tokens_evaluated == len(first)
        second = first + drawn + eng.prompt_tokens("\nQ: And 3 + 3?\nA:")[1:]
        steps = eng.stream(second, 4, reuse_prefix=True)
        list(steps)
        kept = len(first) + len(drawn) - 1  # the last drawn token was never decoded
        assert steps.prompt_tokens_evaluated == len(second) - kept
        steps = eng.stream(second, 4)  # no reuse: all of it
        list(steps)
        assert steps.prompt_tokens_evaluated == len(second)
    finally:
        eng.close()


HARMONY_GRAMMAR = ('root ::= <|channel|> "analysis" <|message|> "We add." <|end|> <|start|> "assistant" '
                   '<|channel|> "final" <|message|> "It is 5."')


def test_gpt_oss_channels_shown_as_thinking_and_answer(llama_cpp):
    """gpt-oss answers in channels (saem_gguf.harmony): the analysis is shown as the thinking (dimmed,
    folded by --hide-thinking) and the final channel as the answer, as llama-cli shows them; the
    history keeps the answer alone, so the next turn renders (gpt-oss's template refuses channel
    markup in a message: the second turn failed before)."""
    from saem_gguf.testmodels import ModelSpec, ensure_model

    model = str(ensure_model(ModelSpec(arch="gpt-oss", chat_template="gpt-oss")))
    r = _chat_piped("-m", model, "--grammar", HARMONY_GRAMMAR, "--no-show-timings", stdin="What is 2+3?\nAnd 3+2?\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "<think>We add.</think>It is 5.\n" * 2, (r.stdout, r.stderr)
    folded = _chat_piped("-m", model, "--grammar", HARMONY_GRAMMAR, "--hide-thinking", stdin="What is 2+3?\n")
    assert "<|channel|>" not in folded.stdout and folded.stdout.startswith("[thinking… ") and "It is 5." in folded.stdout
