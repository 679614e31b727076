"""The interactive chat loop: multi-turn with the model's chat template, streaming, slash commands.

A conversation that outgrows the context loses its oldest turns (the system message stays), with a
one-line notice; a single message too long for the context is refused with one line, and the
session goes on. Ctrl-C while the model answers stops that answer (what was said so far stays in
the history); Ctrl-C at the prompt only reminds how to quit; Ctrl-D or /quit ends. llama-cli's
commands work as there: /clear, /regen, /exit, /read FILE and /glob PATTERN (chat_files.py). On a
terminal lines are edited and recalled with readline (history kept under the cache dir); when stdin is not
a terminal each input line is one user turn, so the chat can be scripted. How an answer is printed
(thinking dimmed or folded, stage marks) is chat_display.py.
"""

from __future__ import annotations

import codecs
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from saem_gguf.chat_display import PIECE_SLACK, AnswerPrinter, use_style
from saem_gguf.chat_files import GLOB_MAX_FILES, file_block, glob_files
from saem_gguf.engine import GREEDY, SEED_RANDOM, ChatPrompt, Engine, SamplingConfig
from saem_gguf.errors import SaemError
from saem_gguf.harmony import HarmonyText, template_is_harmony
from saem_gguf.thinking import THINK_CLOSE, THINK_OPEN

HELP = ("/stats  placement statistics   /clear (/reset)  new conversation   /regen  answer the last message "
        "again   /read FILE  add a text file to the next message   /glob PATTERN  add the files it matches   "
        "/exit (/quit)  exit   /help  this")


@dataclass
class ChatSession:
    engine: Engine
    system: str | None = None
    n_predict: int = -1  # as llama-cli: until end of generation (a full context ends it too)
    sampling: SamplingConfig = GREEDY
    show_stages: bool = False
    hide_thinking: bool = False  # fold <think>…</think> into one line
    color: str = "auto"  # dim the thinking: "on", "off", or "auto" (chat_display.use_style)
    show_timings: bool = False  # llama-cli's line of prompt and generation speed after each answer
    out: TextIO = sys.stdout
    notify: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr))
    messages: list[dict] = field(default_factory=list)
    last_prompt: ChatPrompt | None = None  # what the last turn sent to the model
    last_finish_reason: str | None = None  # how its answer ended: "stop" or "length"
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    pending: str = ""  # text files (/read, /glob) the next message starts with
    turns: int = 0  # messages sent to be answered (/regen's too), answered or not

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.pending = ""

    def _answer_room(self, n_ctx: int) -> int:
        """Context kept free for the answer when old turns are dropped: -n tokens (a quarter of the
        context for -n -1), at most half of it."""
        want = self.n_predict if self.n_predict > 0 else n_ctx // 4
        return min(want, n_ctx // 2)

    def _fit_prompt(self) -> ChatPrompt:
        """The prompt of the conversation so far; when it leaves less than the answer's room, the
        oldest turns go (the system message stays) with a one-line notice. A last message that
        cannot fit on its own raises SaemError."""
        eng = self.engine
        n_ctx = eng.llm.n_ctx()
        room = self._answer_room(n_ctx)
        first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        alone = len(eng.chat_prompt(self.messages[:first] + self.messages[-1:]).tokens)
        if alone >= n_ctx:  # checked first: a refused message costs no history
            raise SaemError(f"this message does not fit the context ({alone} tokens with the chat "
                            f"template{' and system prompt' if first else ''}, -c {n_ctx}); it was not sent")
        dropped = 0
        while True:
            prompt = eng.chat_prompt(self.messages)
            if len(prompt.tokens) + room <= n_ctx or len(self.messages) - first <= 1:
                break  # fits (the last message alone may leave less room for the answer)
            # one turn: the oldest user message and the replies up to the next user message
            end = first + 1
            while end < len(self.messages) - 1 and self.messages[end]["role"] != "user":
                end += 1
            del self.messages[first:end]
            dropped += 1
        if dropped:
            self.notify(f"[context full (-c {n_ctx}): dropped the {dropped} oldest "
                        f"turn{'s' if dropped > 1 else ''}]")
        return prompt

    def answer(self, user: str) -> str | None:
        """Stream the model's answer to ``user``; returns it (partial if interrupted), or None
        when the turn could not be sent (it is then not kept in the history)."""
        try:
            user.encode("utf-8")
        except UnicodeEncodeError:
            # undecodable input bytes reach us as lone surrogates (surrogateescape)
            self.notify("error: the message is not valid UTF-8; it was not sent")
            return None
        self.messages.append({"role": "user", "content": user})
        return self._respond(self.sampling)

    def regenerate(self) -> str | None:
        """/regen: the last answer dropped and the last message answered again (llama-cli's);
        at a temperature above 0 with no seed given (-s), with a new random seed, so the answer
        can differ. None when there is no answer to redo."""
        if len(self.messages) < 2 or self.messages[-1]["role"] != "assistant":
            self.notify("error: no message to regenerate")
            return None
        self.messages.pop()
        sampling = self.sampling
        if sampling.seed is None and self.engine.cfg.seed in (None, -1, SEED_RANDOM):
            sampling = replace(sampling, seed=-1)
        return self._respond(sampling)

    def add_files(self, paths: list[Path], shown: list[str]) -> None:
        """/read and /glob: each file's text, headed by its name, goes before the next message."""
        for path, name in zip(paths, shown):
            try:
                self.pending += file_block(path, name)
            except OSError:
                self.notify(f"error: file does not exist or cannot be opened: {name!r}")
                continue
            except UnicodeDecodeError:
                self.notify(f"error: file is not UTF-8 text: {name!r}")
                continue
            self._write(f"[loaded text from {name!r}]\n")

    def _respond(self, sampling: SamplingConfig) -> str | None:
        """Stream the answer to the conversation so far (it ends with the user's message)."""
        import time

        self.turns += 1
        try:
            prompt = self._fit_prompt()
        except SaemError as e:
            self.messages.pop()
            self.notify(f"error: {e}")
            return None
        self.last_prompt = prompt
        eng = self.engine
        ev_seen = len(eng.placement.stats.events) if eng.placement else 0
        text = bytearray()
        # pieces may end inside a UTF-8 character: the decoder holds such bytes back
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        styled = use_style(self.out) if self.color == "auto" else self.color == "on"
        printer = AnswerPrinter(self.out, styled=styled, hide_thinking=self.hide_thinking,
                                hold_chars=self._cue_hold())
        # gpt-oss answers in channels: shown as thinking and answer, as llama-cli shows them
        channels = ChannelDisplay() if template_is_harmony(eng.chat_template_source()) else None
        show = channels.shown if channels is not None else (lambda s, final=False: s)
        t0 = None
        n = 0
        interrupted = False
        t_start = time.perf_counter()
        steps = eng.stream(prompt, self.n_predict, sampling, reuse_prefix=True)
        try:
            for tok, piece in steps:
                if t0 is None:
                    t0 = time.perf_counter()
                n += tok is not None
                # the events so far were fired by the pieces already fed
                if self.show_stages and eng.placement and len(eng.placement.stats.events) > ev_seen:
                    for e in eng.placement.stats.events[ev_seen:]:
                        printer.stage_mark(e.source, e.cue)
                    ev_seen = len(eng.placement.stats.events)
                text += piece
                printer.feed(show(decoder.decode(piece)))
        except KeyboardInterrupt:
            interrupted = True
        self.last_finish_reason = steps.finish_reason
        if t0 is not None:
            t_end = time.perf_counter()
            self.decode_seconds += t_end - t0
            self.decode_tokens += n
        # the history holds what llama-cpp-python's create_chat_completion would return; of
        # gpt-oss's channels, the answer (its template refuses channel markup in a message)
        reply = text.decode("utf-8", errors="ignore")
        printer.feed(show(decoder.decode(b"", final=True), final=True))
        if channels is not None:
            reply = channels.harmony.whole(reply)[1]
        printer.finish()
        self._write("\n" + ("[interrupted]\n" if interrupted else ""))
        if self.show_timings and t0 is not None:
            # llama-server's rates, which llama-cli shows: the prompt tokens decoded (a reused
            # prefix not counted) over the time to the first token, the tokens drawn over the rest
            prompt_s, gen_s = t0 - t_start, t_end - t0
            self.notify(f"[ Prompt: {steps.prompt_tokens_evaluated / prompt_s if prompt_s > 0 else 0.0:.1f} t/s | "
                        f"Generation: {n / gen_s if gen_s > 0 else 0.0:.1f} t/s ]")
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    def _cue_hold(self) -> int:
        """Characters the printer holds back so a stage mark can go before its cue (0: no marks)."""
        placement = self.engine.placement
        cues = placement.detector.cues if self.show_stages and placement is not None else None
        if not cues:
            return 0
        return max(len(t) for t in cues.texts) + PIECE_SLACK

    def stats_text(self) -> str:
        s = self.engine.stats()
        tps = self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
        lines = [f"policy {s['policy']}", f"decode {self.decode_tokens} tokens, {tps:.1f} tokens/s"]
        if "hit_rate" in s:
            uneven = len(set(s["slot_layout"])) > 1
            layout = f", per layer {'/'.join(map(str, s['slot_layout']))}" if uneven else ""
            lines += [f"expert cache: {s['slots_per_layer']} slots/layer (ECR {s['ecr']:.1%}{layout})",
                      f"hit rate {s['hit_rate']:.1%} ({s['hits']}/{s['expert_accesses']} expert uses)",
                      f"moved {s['bytes_moved'] / 1e6:.2f} MB in {s['copies']} copies "
                      f"({s['mb_moved_per_token']:.3f} MB/token)",
                      f"stage boundaries {s['boundaries']}, placement updates {s['plans']}"]
        return "\n".join(lines)

    def _write(self, s: str) -> None:
        self.out.write(s)
        self.out.flush()

    def handle(self, line: str) -> bool:
        """One line of user input; False when the session should end."""
        cmd = line.strip()
        if not cmd:
            return True
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/stats":
            self._write(self.stats_text() + "\n")
        elif cmd in ("/reset", "/clear"):
            self.reset()
            self._write("[new conversation]\n")
        elif cmd == "/regen":
            self.regenerate()
        elif cmd.startswith("/read "):
            name = cmd[len("/read "):].strip()
            self.add_files([Path(name)], [name])
        elif cmd.startswith("/glob "):
            found = glob_files(cmd[len("/glob "):].strip(), Path.cwd())
            if len(found) > GLOB_MAX_FILES:
                found = found[:GLOB_MAX_FILES]
                self.notify(f"error: at most {GLOB_MAX_FILES} files are read from a pattern; the rest were not")
            self.add_files(found, [str(p) for p in found])
            if not found:
                self._write("[no file matches]\n")
        elif cmd == "/help":
            self._write(HELP + "\n")
        elif cmd.startswith("/"):
            self._write(f"unknown command {cmd}; {HELP}\n")
        else:
            text, self.pending = self.pending + line.rstrip("\n"), ""
            self.answer(text)
        return True


HISTORY_LINES = 1000  # the history file keeps the most recent lines


@dataclass
class ChannelDisplay:
    """gpt-oss's channels (saem_gguf.harmony) as the printer's thinking block and answer: the
    analysis between ``<think>`` and ``</think>``, which the printer dims or folds, then the final
    channel's text."""

    harmony: HarmonyText = field(default_factory=lambda: HarmonyText(extract_reasoning=True))
    thinking: bool = False  # inside the shown <think> block

    def shown(self, text: str, final: bool = False) -> str:
        reasoning, content = self.harmony.add(text, final)
        out = ""
        if reasoning:
            out += ("" if self.thinking else THINK_OPEN) + reasoning
            self.thinking = True
        if content and self.thinking:
            out += THINK_CLOSE
            self.thinking = False
        return out + content


def default_history_file() -> Path:
    from saem_gguf.build.paths import cache_root

    return cache_root() / "chat_history"


def run_repl(session: ChatSession, inp: TextIO = sys.stdin, history_file: Path | None = None,
             first_message: str | None = None, single_turn: bool = False) -> None:
    """Read user lines until /quit or end of input. On a terminal ``input`` edits lines with the
    standard readline module and recalls earlier lines (also from earlier sessions: ``history_file``,
    default <cache>/chat_history, bounded to HISTORY_LINES); otherwise each line is one turn.
    As llama-cli: ``first_message`` (-p) is handled before any line is read (shown after the
    prompt mark on a terminal), and ``single_turn`` (-st) ends the chat after one message was
    sent to be answered (commands such as /read do not count)."""
    interactive = inp.isatty()
    history = None
    if interactive:
        history = _load_history(history_file or default_history_file())
        print(f"chat with {session.engine.path.name} — {HELP}", file=sys.stderr)
    try:
        while True:
            if first_message is not None:
                line, first_message = first_message, None
                if interactive:
                    print(f"> {line}", flush=True)
            else:
                try:
                    line = input("> ") if interactive else inp.readline()
                except KeyboardInterrupt:
                    print("\n(/quit or Ctrl-D to exit)", file=sys.stderr)
                    continue
                except EOFError:
                    break
                if not interactive and line == "":
                    break
            turns = session.turns
            if not session.handle(line) or (single_turn and session.turns > turns):
                break
    finally:
        if history is not None:
            _save_history(history)


def _load_history(path: Path) -> Path | None:
    try:
        import readline  # line editing for input(); absent on some platforms
    except ImportError:
        return None
    readline.set_history_length(HISTORY_LINES)
    try:
        readline.read_history_file(path)
    except OSError:
        pass  # none yet, or unreadable: the history starts afresh
    return path


def _save_history(path: Path) -> None:
    import readline

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(path)  # truncated to set_history_length
    except OSError as e:
        print(f"[saem] chat history not saved to {path}: {e.strerror or e}", file=sys.stderr)
