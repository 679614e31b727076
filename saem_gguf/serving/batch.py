"""Continuous batching: up to ``n_parallel`` requests decode together on one loaded model.

One decode thread owns the engine's llama context. Each step it (1) retires cancelled
sequences and frees their KV cells (``llama_memory_seq_rm``), (2) admits waiting requests into
free slots, (3) evaluates one prompt ubatch (``-ub`` tokens) of each sequence still prefilling,
in a ``llama_decode`` of its own, as ``Engine.generate`` evaluates it (placement sees it as
``on_prompt``), sampling the first token after the last one, (4) decodes one token of every
sequence that has one, with logits for each, (5) samples each with its own llama-cpp-python
sampler chain, releases its text and retires the finished ones, and (6) hands the step's
routing, one row per sequence, to ``Placement.on_step``.

KV layout (with ``EngineConfig.kv_unified``, llama-server's default without ``-np``, the sequences
share one stream instead, each able to use all ``n_ctx`` cells: steps go out every ``-ub`` rows, and
a decode that finds no free cells clears the free slots' kept cells first; ``_decode``). Split: the
context holds ``n_parallel`` sequences in one KV stream each (``kv_unified`` off,
llama-server's default with ``-np N``): a slot's sequence has ``n_ctx / n_parallel`` cells (llama.cpp
rounds up to a multiple of 256), laid out from cell 0 and filled by the same prompt ubatches as
when it is served alone. llama.cpp decodes a batch of split streams in ubatches of consecutive
sequence ids (``llama_batch_allocr::split_equal``); the scheduler issues those ubatches itself,
one ``llama_decode`` per run of consecutive busy slots, so that each one's routing is read (the
native counters keep the last ubatch only). The decode work is what llama.cpp would do for one
call. A step of several rows multiplies the dense weights with ggml's sgemm instead of the
one-row dot products, so its logits may differ from a lone decode in the last bits (measured,
docs/ARCHITECTURE.md "A batch step"); for the same schedule they are identical under every
policy and cache size.

Fidelity (``Engine.stream``'s rules, and llama-server's where they differ): the same
SamplingConfig chain built by llama-cpp-python's ``_init_sampler`` (greedy at temperature 0, else
top-k, typical, top-p, min-p, temperature and a seeded draw; ``ignore_eos`` as a -inf logit bias
first; a grammar checked after the draw as llama-server's common sampler does), or llama.cpp's
common chain where a request names an order or a sampler that chain lacks (DRY, XTC,
top-n-sigma, dynamic temperature, Mirostat: samplers.server_sampler); the prompt's tokens fed to
the chain before the first draw, as llama-server's ``init_sampler`` does, so that the penalties
and DRY look back over the prompt too (the grammar only follows what is generated),
a stop at every end-of-generation token (``llama_vocab_is_eog``), stop strings with hold-back
(``engine.StopText``) and each token's text by ``Engine._piece_after``; llama-server's own limits
of /completion and /infill (``LineLimits``: an indentation each new line must keep, a time after
which a new line ends the answer).

Prompt cache (llama-server's ``cache_prompt`` and ``--cache-ram``): a finished request's KV cells
stay in its slot (``_kept``); a new request goes to the free slot whose cells hold the largest
share of its prompt (above ``slot_similarity``), else to the least recently used one, and its
prefill starts where the cells stop agreeing with it (at least its last prompt token is
evaluated, for the logits its first token is sampled from). Cells a slot is about to lose go to
the host-memory cache (serving.prompt_cache) and the cached prompt that serves the request
better comes back in, as llama-server's ``get_available_slot`` does. Reused cells were computed
in other ubatches than a fresh prefill would use, so the logits may differ in the last bits, as
llama-server's do when it reuses its cache.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import numpy as np

from saem_gguf.detokenize import token_piece
from saem_gguf.engine import (
    ChatPrompt, Engine, SamplingConfig, StopText, check_logit_bias, check_token_ids, resolve_seed,
)
from saem_gguf.errors import SaemError
from saem_gguf.grammar import ChainSampler, GrammarDeadEnd, check_grammar
from saem_gguf.resources import at_most_trained
from saem_gguf.samplers import feed_prompt, server_sampler
from saem_gguf.serving.infill import FimTokens
from saem_gguf.serving.prompt_cache import PromptCache, common_prefix


@dataclass(frozen=True)
class BatchRequest:
    prompt_tokens: list[int]  # already tokenized (tokenize_prompt / tokenize_chat)
    max_tokens: int  # n_predict (< 0: until the sequence's context is full); also stops there
    sampling: SamplingConfig  # seed None: a random one per request
    extra_stops: tuple[str, ...] = ()  # the chat format's stop strings, added to sampling.stop
    n_probs: int = 0  # top log-probs per generated token (0: none; at most the vocabulary's)
    # llama-server's post_sampling_probs: with n_probs, the probabilities the sampler chain left at
    # the draw (ChainSampler.drawn_probabilities), at most n_probs of them, in place of log-probs
    post_sampling_probs: bool = False
    # a chat prompt's text (None: a raw prompt): a chat's reasoning budget counts from the
    # thinking block its generation prompt opens (Engine.reasoning_budget)
    chat_text: str | None = None
    lines: LineLimits | None = None  # llama-server's n_indent / t_max_predict_ms (None: neither)
    # llama-server's cache_prompt: start from the cells a free slot kept of an earlier request
    # that shares the prompt's beginning (Scheduler._admit); its own are kept for the next either way
    cache_prompt: bool = True
    infill: bool = False  # an /infill request: it leaves the prompt cache as it is (as llama-server's)

    @property
    def wants_drawn_probabilities(self) -> bool:
        """post_sampling_probs with n_probs: the chain's probabilities in place of log-probs."""
        return self.post_sampling_probs and self.n_probs > 0


@dataclass(frozen=True)
class LineLimits:
    """llama-server's line limits of /completion and /infill (server-context.cpp's
    ``process_token``), for editor plugins: ``n_indent`` > 0, every new line must start with at
    least that many spaces or tabs, else the answer ends there (stop type limit) and its whole
    text is cut before the line's first other character; ``t_max_predict_ms`` > 0, once the
    generation has run that long, the next token whose text holds a newline ends it."""

    n_indent: int = 0
    t_max_predict_ms: float = 0.0


@dataclass
class LineState:
    """What ``LineLimits`` track of one answer, as llama-server's slot does."""

    limits: LineLimits
    has_new_line: bool = False  # a released text held a newline
    last_nl_pos: int = 0  # where the line being checked starts (0: none yet)

    def indent_cut(self, text: bytes | bytearray) -> int | None:
        """After a token: the length the text is cut to when the line being checked breaks the
        indentation rule, else None. llama-server's order and quirks: a line is checked from the
        token after the one that moved ``last_nl_pos`` to it, and ``last_nl_pos`` moves at most one
        line per token."""
        if not (self.has_new_line and self.limits.n_indent > 0):
            return None
        cut = None
        if self.last_nl_pos > 0:
            pos = self.last_nl_pos
            while pos < len(text) and text[pos] in b" \t":
                pos += 1
            if pos < len(text) and pos - self.last_nl_pos < self.limits.n_indent:
                cut = pos
                text = text[:pos]
        nl = text.find(b"\n", self.last_nl_pos)
        if nl >= 0:
            self.last_nl_pos = nl + 1
        return cut

    def out_of_time(self, released: bytes, gen_ms: float) -> bool:
        """After a token's text is released: whether the time limit ends the answer here."""
        if b"\n" not in released:
            return False
        self.has_new_line = True
        return 0 < self.limits.t_max_predict_ms < gen_ms


@dataclass(frozen=True)
class TokenEvent:
    text: bytes  # released text (held back while it may begin a stop string)
    token_ids: tuple[int, ...]  # tokens whose text this event releases
    # per token: (chosen logprob, ((token_id, logprob), ...)) when n_probs; probabilities in
    # their place under post_sampling_probs
    logprobs: tuple | None
    finish_reason: str | None  # None, then on the last event: stop | length | cancelled | error
    error: str | None = None  # one line, when finish_reason == "error"
    usage: tuple[int, int] | None = None  # (prompt_tokens, completion_tokens) on the last event
    cached: int = 0  # prompt tokens whose cells an earlier request left (not evaluated)
    stop_word: str | None = None  # on the last event: the stop string that ended the text, if one did
    # on the last event: (seconds from admission to the first sampled token, from there to the end)
    timings: tuple[float, float] | None = None
    # on the last event: the bytes of the whole text the answer keeps when a line limit cut it
    # (LineLimits; a stream has sent the rest already, as llama-server's), else None
    keep: int | None = None


WARM_UP_TOKENS = 4  # tokens each slot decodes in Scheduler.warm_up


class QueueFull(SaemError):
    """Every slot is busy and the waiting queue is full (HTTP 503)."""


class SchedulerStopped(QueueFull):
    """The scheduler no longer accepts requests (it is stopping, or its decode thread failed)."""


class EmptyPrompt(SaemError):
    """The prompt has no tokens (HTTP 400): an empty text where the model adds no BOS token.
    llama-server answers an empty completion there; a 400 says why nothing was generated."""


class PromptTooLong(SaemError):
    """The prompt leaves no room for a token in one sequence's context (HTTP 400)."""


class SequenceHandle:
    """One accepted request: its events, in order, and a way to cancel it (thread-safe)."""

    def __init__(self, scheduler: Scheduler, req: BatchRequest, seed: int) -> None:
        self.request = req
        self.seed = seed  # the sampling seed in use (drawn at submit when the request gave none)
        self.slot = -1  # the slot serving it, once admitted (llama-server's id_slot)
        self._scheduler = scheduler
        self._cond = threading.Condition()
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._finished = False  # the final event has been pushed
        self._cancelled = False
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def cancel(self) -> None:
        """Stop generating: the final event says "cancelled" (unless the request has already
        ended), and the slot and its KV cells are freed before the next decode step."""
        self._scheduler._cancel(self)

    def _push(self, ev: TokenEvent, wakes: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] | None = None) -> None:
        """Queue ``ev`` and wake its consumers: a blocked ``events()`` at once, an ``aevents()``
        at once too, or, given ``wakes``, when the caller passes that list to ``_wake_loops``
        (the decode thread wakes each event loop once per step, not once per token)."""
        with self._cond:
            if self._finished:
                return
            self._events.append(ev)
            self._finished = ev.finish_reason is not None
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
        if wakes is None:
            _wake_loops(waiters)
        else:
            wakes.extend(waiters)

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Blocking iterator over the events, ending after the final one. ``timeout``: seconds
        to wait for each event before raising TimeoutError."""
        while True:
            with self._cond:
                if not self._events and not self._cond.wait_for(lambda: bool(self._events), timeout):
                    raise TimeoutError(f"no event from the scheduler within {timeout} s")
                ev = self._events.popleft()
            yield ev
            if ev.finish_reason is not None:
                return

    async def aevents(self) -> AsyncIterator[TokenEvent]:
        """The events for asyncio: the decode thread wakes the waiting loop."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                ev = self._events.popleft() if self._events else None
                if ev is None:
                    flag = asyncio.Event()
                    self._async_waiters.append((loop, flag))
            if ev is None:
                await flag.wait()
                continue
            yield ev
            if ev.finish_reason is not None:
                return


@dataclass
class _Sequence:
    """A request in a slot (decode-thread state)."""

    handle: SequenceHandle
    slot: int
    limit: int  # tokens it may generate
    sampler: object  # llama_cpp._internals.LlamaSampler
    text: StopText
    n_past: int = 0  # tokens in its KV cells
    tokens: list[int] = field(default_factory=list)  # generated
    next_token: int | None = None  # sampled, to be decoded in the next step
    t_admitted: float = field(default_factory=time.perf_counter)
    t_first: float | None = None  # when its first token was sampled (its prompt done)
    n_cached: int = 0  # prompt tokens whose cells were kept from an earlier request (cache_prompt)
    # llama-server's line limits (none set: zeros, and its has_new_line is still kept for /slots)
    lines: LineState = field(default_factory=lambda: LineState(LineLimits()))
    task: int = 0  # the request's number, in order of admission (/slots' id_task)
    n_sampled: int = 0  # tokens drawn, the end of generation's included (llama-server's n_gen)
    ended: bool = False  # its final event was pushed

    @property
    def n_prompt(self) -> int:
        return len(self.handle.request.prompt_tokens)


@dataclass(frozen=True)
class TaskState:
    """A slot's current or last request as llama-server's /slots tells of it (server_slot::to_json)."""

    task: int  # its number, in order of admission (id_task)
    request: BatchRequest
    n_cells: int  # the slot's KV cells: its prompt and the tokens decoded after it (n_prompt_tokens)
    n_prompt_processed: int = 0  # prompt tokens evaluated (the rest came from the prompt cache)
    n_prompt_cached: int = 0
    n_decoded: int = 0  # tokens drawn, the end of generation's included
    n_remain: int = -1  # tokens it may still draw (-1: no limit but the context)
    has_next_token: bool = False  # still generating
    has_new_line: bool = False  # a newline was released


@dataclass(frozen=True)
class SlotState:
    busy: bool  # a request is in it (is_processing)
    task: TaskState | None  # None: no request has been in it yet


def _task_state(seq: _Sequence) -> TaskState:
    req = seq.handle.request
    return TaskState(task=seq.task, request=req, n_cells=seq.n_past,
                     n_prompt_processed=max(0, min(seq.n_past, seq.n_prompt) - seq.n_cached),
                     n_prompt_cached=seq.n_cached, n_decoded=seq.n_sampled,
                     n_remain=-1 if req.max_tokens < 0 else req.max_tokens - seq.n_sampled,
                     has_next_token=not seq.ended, has_new_line=seq.lines.has_new_line)


class Scheduler:
    """Continuous batching over ``engine``'s model (see the module docstring). The engine is the
    scheduler's alone while it runs: do not generate through the engine meanwhile."""

    def __init__(self, engine: Engine, n_parallel: int, queue_max: int = 64, cache_ram_mib: int = 8192,
                 slot_similarity: float = 0.1) -> None:
        """``cache_ram_mib``: llama-server's --cache-ram, the host memory the prompt cache may hold
        (-1: no limit, 0: none); ``slot_similarity``: its --slot-prompt-similarity, the share of a
        prompt a free slot's cells must hold for the request to go there rather than to the
        least recently used slot (0: always the least recently used)."""
        if n_parallel < 1 or n_parallel > engine.cfg.n_parallel:
            raise SaemError(f"the scheduler's {n_parallel} slots need an engine loaded with n_parallel >= "
                            f"{n_parallel} (it has {engine.cfg.n_parallel})")
        if queue_max < 0:
            raise SaemError(f"queue_max must be >= 0, got {queue_max}")
        self.engine = engine
        self.n_parallel = n_parallel
        self.queue_max = queue_max
        self._lc = engine._llama_cpp
        self._ctx = engine.llm.ctx
        self._llama_ctx = engine.llm._ctx  # the LlamaContext a sampler's sample() takes
        self._mem = self._lc.llama_get_memory(self._ctx)
        # a slot's context: its share of the KV cache, at most what the model was trained on, as
        # llama-server's n_ctx_slot caps it
        self._n_ctx_seq = at_most_trained(engine.n_ctx_seq, engine.info)
        self._n_ubatch = int(self._lc.llama_n_ubatch(self._ctx))
        self._unified = engine.cfg.kv_unified  # one KV stream the slots share (-kvu)
        self._n_vocab = engine.llm.n_vocab()
        self._vocab = engine.llm._model.vocab
        self._lock = threading.Lock()  # guards the queue, the slots' handles and the counters
        self._wake = threading.Condition(self._lock)
        self._tokenize_lock = threading.Lock()
        self._waiting: collections.deque[SequenceHandle] = collections.deque()
        self._slots: list[_Sequence | None] = [None] * n_parallel
        # per slot, the sequence it serves or served last (/slots tells of it, as llama-server's
        # slot of its task or its previous one)
        self._last: list[_Sequence | None] = [None] * n_parallel
        # per free slot, the tokens whose KV cells it kept from its last request (cache_prompt)
        self._kept: list[list[int]] = [[] for _ in range(n_parallel)]
        self._last_used = [-1] * n_parallel  # when each slot's last request ended (a count, for LRU)
        self._uses = 0
        self._slot_similarity = slot_similarity
        self._prompt_cache = None if cache_ram_mib == 0 else \
            PromptCache(cache_ram_mib, int(self._lc.llama_n_ctx(self._ctx)))
        self._accepting = True
        self._draining = True
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self._batch = self._lc.llama_batch_init(max(self._n_ubatch, n_parallel), 0, 1)
        self._requests = 0
        self._requests_admitted = 0  # the next admitted request's number (_Sequence.task)
        self._cached_tokens = 0  # prompt tokens the prompt cache served (not evaluated)
        self._tokens = 0  # generated
        self._steps = 0  # decode steps (one token of each decoding sequence)
        self._rows = 0  # tokens those steps decoded
        self._step_decodes = 0  # llama_decode calls those steps made (one per run of consecutive slots)
        self._t_started: float | None = None
        # async consumers to wake after the decode thread's current step (its events' wake-ups, one
        # per event loop: _wake_loops)
        self._step_wakes: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def n_ctx_seq(self) -> int:
        """Tokens one request may hold, prompt and reply together (its share of ``-c``, or all of it
        in a shared cache; at most the model's training context, as llama-server's)."""
        return self._n_ctx_seq

    # --- requests in ---------------------------------------------------------------------------
    def check_grammar(self, grammar: str, what: str = "the request's grammar") -> None:
        """SaemError (one line) where llama.cpp cannot parse ``grammar`` for this model (the
        sampler is built on the decode thread, where a NULL grammar would be too late to refuse)."""
        check_grammar(self._lc, self._vocab, grammar, what)

    def tokenize_mixed(self, content: str | list[str | int], add_special: bool, parse_special: bool) -> list[int]:
        """llama-server's ``tokenize_mixed`` (its /tokenize): strings tokenized, ``add_special``
        only for the first element, token ids kept (checked against the vocabulary; thread-safe)."""
        parts = [content] if isinstance(content, str) else content
        out: list[int] = []
        with self._tokenize_lock:
            for i, part in enumerate(parts):
                if isinstance(part, int):
                    out.append(part)
                else:
                    out += self.engine.llm.tokenize(part.encode("utf-8"), add_bos=add_special and i == 0,
                                                    special=parse_special)
        check_token_ids(out, self._n_vocab, "token")
        return out

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        """Each token's text as llama.cpp's ``common_token_to_piece`` gives it (special tokens'
        text included; what llama-server's /tokenize and /detokenize use); ids checked."""
        check_token_ids(tokens, self._n_vocab, "token")
        vocab = self.engine.llm._model.vocab
        return [token_piece(self._lc, vocab, t, True) for t in tokens]

    def fim_tokens(self) -> FimTokens:
        """The vocabulary's fill-in-the-middle tokens (llama.cpp's, from the GGUF or found by their
        text, as for Qwen-Coder GGUFs)."""
        lc, v = self._lc, self._vocab
        return FimTokens(pre=lc.llama_vocab_fim_pre(v), suf=lc.llama_vocab_fim_suf(v), mid=lc.llama_vocab_fim_mid(v),
                         rep=lc.llama_vocab_fim_rep(v), sep=lc.llama_vocab_fim_sep(v))

    def added_bos(self) -> int | None:
        """The BOS token where the vocabulary puts one before a prompt (llama_vocab_get_add_bos), else None."""
        return int(self._lc.llama_vocab_bos(self._vocab)) if self._lc.llama_vocab_get_add_bos(self._vocab) else None

    def tokenize_prompt(self, prompt: str, parse_special: bool = False) -> list[int]:
        """A raw prompt's tokens by ``Engine.prompt_tokens``'s rules (thread-safe)."""
        with self._tokenize_lock:
            return self.engine.prompt_tokens(prompt, parse_special)

    def tokenize_chat(self, messages: list[dict], template_kwargs: dict | None = None,
                      add_generation_prompt: bool = True) -> ChatPrompt:
        """A chat's prompt by ``Engine.chat_prompt``'s rules (thread-safe)."""
        with self._tokenize_lock:
            return self.engine.chat_prompt(messages, template_kwargs, add_generation_prompt)

    def submit(self, req: BatchRequest) -> SequenceHandle:
        """Queue ``req``; its handle yields the events. Raises PromptTooLong, QueueFull (already
        ``n_parallel + queue_max`` requests in the slots or waiting), SchedulerStopped, EmptyPrompt,
        or SaemError for a token outside the vocabulary, a bad seed or ``n_probs``."""
        if not req.prompt_tokens:
            raise EmptyPrompt("empty prompt (and the model adds no BOS token to start from)")
        check_token_ids(req.prompt_tokens, self._n_vocab, "prompt token")
        if len(req.prompt_tokens) + 1 > self._n_ctx_seq:
            raise PromptTooLong(f"the prompt ({len(req.prompt_tokens)} tokens) does not fit the context "
                                f"({self._n_ctx_seq} tokens per sequence)")
        check_logit_bias(req.sampling.logit_bias, self._n_vocab)
        if req.n_probs < 0:  # more than the vocabulary holds is all of it, as llama-server's
            raise SaemError(f"n_probs must be >= 0, got {req.n_probs}")
        handle = SequenceHandle(self, req, resolve_seed(req.sampling.seed))
        with self._lock:
            if not self._accepting or self._failure is not None:
                raise SchedulerStopped(self._failure or "the server is shutting down")
            busy = sum(s is not None for s in self._slots)
            if len(self._waiting) + busy >= self.n_parallel + self.queue_max:
                raise QueueFull(f"the queue is full ({busy} of {self.n_parallel} slots busy, "
                                f"{len(self._waiting)} requests waiting)")
            self._waiting.append(handle)
            self._requests += 1
            self._wake.notify()
        return handle

    def _cancel(self, handle: SequenceHandle) -> None:
        with self._lock:
            handle._cancelled = True
            if handle in self._waiting:  # never started: it ends here
                self._waiting.remove(handle)
                handle._push(TokenEvent(b"", (), None, "cancelled", usage=(len(handle.request.prompt_tokens), 0)))
            self._wake.notify()

    # --- lifecycle -----------------------------------------------------------------------------
    def _warm_up(self, prompt_tokens: list[int], n_tokens: int = WARM_UP_TOKENS) -> None:
        """``prompt_tokens`` in every slot, greedy, for ``n_tokens`` tokens each, through the decode
        loop's own steps, so that the one-time costs of the first steps (compiling or loading the
        placement's Numba kernels, about 11 s on a fresh checkout here; llama.cpp's first graphs
        of one and of every batch size) are paid before the server says it is ready, as
        llama-server's warm-up run is. Then every slot is empty again (KV cells freed) and the counters, the
        engine's placement figures included, start from zero; residency stays what the policy
        chose (placement never changes results)."""
        req = BatchRequest(list(prompt_tokens), n_tokens, SamplingConfig(temp=0.0, ignore_eos=True))
        for slot in range(self.n_parallel):
            self._admit(slot, SequenceHandle(self, req, seed=0))
        while any(s is not None for s in self._slots):
            self._decode_step()
        for slot in range(self.n_parallel):  # its cells serve no request
            self._lc.llama_memory_seq_rm(self._mem, slot, -1, -1)
            self._kept[slot] = []
        with self._lock:
            self._tokens = self._steps = self._rows = self._step_decodes = self._cached_tokens = 0
        self._last_used, self._uses = [-1] * self.n_parallel, 0  # no slot used yet, as llama-server's
        self.engine.reset_stats()

    def start(self, warm_up: list[int] | None = None) -> None:
        """Start the decode thread. With ``warm_up`` (a prompt's tokens) the thread first runs the
        warm-up (``_warm_up``), and start() returns when it is done, raising SaemError if it
        failed. The warm-up runs on the decode thread because every ``llama_decode`` must: the
        CPU build's OpenMP keeps a team of worker threads per calling thread, and with more of
        them than CPUs libgomp stops spinning between decodes (measured: -np 1 at -t 2 fell from
        2566 to 427 tok/s after a warm-up on the main thread)."""
        if self._thread is not None:
            raise SaemError("the scheduler is already started")
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(warm_up, ready), name="saem-decode", daemon=True)
        self._thread.start()
        ready.wait()
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise SaemError(f"the server's warm-up run failed: {failure}")

    def stop(self, drain: bool) -> None:
        """Stop accepting requests. ``drain``: finish every accepted request; otherwise cancel
        them (each still gets its final event). Returns when the decode thread has ended, so an
        event loop should call it off the loop (``await asyncio.to_thread(sched.stop, True)``):
        the loop keeps delivering events meanwhile."""
        with self._lock:
            self._accepting = False
            self._draining = self._draining and drain  # a cancelling stop() is never undone
            if not drain:
                for h in self._waiting:
                    h._cancelled = True
                for s in self._slots:
                    if s is not None:
                        s.handle._cancelled = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        else:  # never started: nothing decodes the queue
            self._end_waiting("cancelled", None)
        with self._lock:  # a second stop() (drain, then cancel) may be returning too
            batch, self._batch = self._batch, None
        if batch is not None:
            self._lc.llama_batch_free(batch)

    def slots_busy(self) -> list[bool]:
        """Whether each slot holds a sequence now (llama-server's /slots ``is_processing``)."""
        with self._lock:
            return [s is not None for s in self._slots]

    def slot_states(self) -> list[SlotState]:
        """Each slot's current request, or its last one, as llama-server's /slots tells of it: a
        request that has ended keeps its number and settings, its counts are reset as
        llama-server's slot resets them at release (the cells it kept aside)."""
        with self._lock:
            out = []
            for i, (now, seq) in enumerate(zip(self._slots, self._last)):
                task = None if seq is None else _task_state(seq) if now is not None else \
                    TaskState(task=seq.task, request=seq.handle.request, n_cells=len(self._kept[i]))
                out.append(SlotState(now is not None, task))
            return out

    def stats(self) -> dict:
        """The engine's placement figures (Engine.stats(): hit rate, bytes moved, boundaries,
        placement updates) and the serving counters: requests accepted, tokens generated, their
        rate since start(), queue length, busy slots, decode steps, their mean batch size
        (sequences per step) and llama_decode calls per step (runs of consecutive slots); the
        prompt tokens the prompt cache served, and the host-memory cache's entries and bytes.
        ``tokens`` is the scheduler's count of generated tokens (it replaces the engine's count
        of decoded ones, one fewer per reply cut by its limit)."""
        d = self.engine.stats()
        with self._lock:
            busy = sum(s is not None for s in self._slots)
            cache = self._prompt_cache
            d.update(prompt_tokens_cached=self._cached_tokens,
                     prompt_cache_entries=len(cache.states) if cache is not None else 0,
                     prompt_cache_bytes=cache.size() if cache is not None else 0)
            d.update(requests=self._requests, tokens=self._tokens, queue_len=len(self._waiting),
                     busy_slots=busy, n_parallel=self.n_parallel, decode_steps=self._steps,
                     mean_batch=round(self._rows / self._steps, 3) if self._steps else 0.0,
                     decodes_per_step=round(self._step_decodes / self._steps, 3) if self._steps else 0.0)
        elapsed = time.perf_counter() - self._t_started if self._t_started is not None else 0.0
        d["tokens_per_s"] = round(d["tokens"] / elapsed, 3) if elapsed > 0 else 0.0
        return d

    # --- the decode thread ---------------------------------------------------------------------
    def _run(self, warm_up: list[int] | None, ready: threading.Event) -> None:
        try:
            try:
                if warm_up is not None:
                    self._warm_up(warm_up)
                self._t_started = time.perf_counter()
            finally:
                ready.set()
            while self._schedule():
                self._decode_step()
                self._wake_step_consumers()
        except Exception as e:  # noqa: BLE001 - every accepted request must still get its final event
            msg = f"the decode loop failed: {type(e).__name__}: {e}".splitlines()[0]
            with self._lock:
                self._failure = msg
                self._accepting = False
            for s in self._slots:
                if s is not None:
                    try:
                        self._finish(s, "error", b"", error=msg)
                    except Exception:  # noqa: BLE001 - the final event is pushed regardless
                        pass
            self._end_waiting("error", msg)
        finally:
            self._wake_step_consumers()

    def _wake_step_consumers(self) -> None:
        wakes, self._step_wakes = self._step_wakes, []
        _wake_loops(wakes)

    def _end_waiting(self, reason: str, error: str | None) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for h in waiting:
            h._push(TokenEvent(b"", (), None, reason, error=error, usage=(len(h.request.prompt_tokens), 0)))

    def _schedule(self) -> bool:
        """Retire cancelled sequences, admit waiting ones into free slots (prefilling them).
        False when the loop should end."""
        while True:
            with self._lock:
                cancelled = [s for s in self._slots if s is not None and s.handle._cancelled]
                if not cancelled:
                    if not self._accepting and not self._draining:
                        for h in self._waiting:
                            h._push(TokenEvent(b"", (), None, "cancelled",
                                               usage=(len(h.request.prompt_tokens), 0)))
                        self._waiting.clear()
                    admit = []
                    free = [slot for slot, s in enumerate(self._slots) if s is None]
                    while free and self._waiting:
                        handle = self._waiting.popleft()
                        slot, update = self._slot_for(handle.request, free)
                        free.remove(slot)
                        admit.append((slot, handle, update, tuple(free)))
                    if admit or any(s is not None for s in self._slots):
                        break
                    if not self._accepting:
                        return False
                    self._wake.wait()
                    continue
            for s in cancelled:  # outside the lock: _finish takes it
                self._finish(s, "cancelled", b"")
            self._wake_step_consumers()  # before the wait below
        for slot, handle, update, idle in admit:
            self._admit(slot, handle, update, idle)
        return True

    def _slot_for(self, req: BatchRequest, free: list[int]) -> tuple[int, bool]:
        """(slot, whether to update the prompt cache) for ``req``, as llama-server's
        ``get_available_slot``: the free slot whose kept cells hold the largest share of its
        prompt, above ``slot_similarity`` (the cache is updated when that would lose more than
        half of them), else the least recently used one (the last of equals; cache updated)."""
        prompt = req.prompt_tokens
        chosen, best = None, 0.0
        if self._slot_similarity != 0.0:
            for slot in free:
                if not self._kept[slot]:
                    continue
                share = common_prefix(self._kept[slot], prompt) / len(prompt)
                if share > best and share > self._slot_similarity:
                    chosen, best = slot, share
            if chosen is not None:
                return chosen, best * len(prompt) / len(self._kept[chosen]) < 0.5
        for slot in free:
            if chosen is None or self._last_used[slot] <= self._last_used[chosen]:
                chosen = slot
        return chosen, True

    def _admit(self, slot: int, handle: SequenceHandle, update_cache: bool = False, idle: tuple[int, ...] = ()) -> None:
        """Put ``handle``'s request in ``slot`` (fresh stage state); its prompt is evaluated by the
        next steps (``_prefill``) from the end of the beginning it shares with the cells the slot
        kept (llama-server's cache_prompt: at least its last token is evaluated, for its logits),
        or from the start. ``update_cache``: first the slot's cells go to the prompt cache and the
        cached prompt that serves the request best comes in (not for /infill, as llama-server);
        after, the ``idle`` slots' cells are saved there too (llama-server's cache_idle_slots)."""
        req = handle.request
        handle.slot = slot
        if update_cache and self._prompt_cache is not None and not req.infill:
            self._save_cells(slot)
            if not self._load_cells(slot, req.prompt_tokens):
                self._lc.llama_memory_seq_rm(self._mem, slot, -1, -1)
                self._kept[slot] = []
            self._prompt_cache.update()
        sampling = req.sampling
        room = self._n_ctx_seq - len(req.prompt_tokens)
        limit = room if req.max_tokens < 0 else min(req.max_tokens, room)
        stops = tuple(s.encode("utf-8") for s in sampling.stop + req.extra_stops)
        budget = None if req.chat_text is None else \
            self.engine.reasoning_budget(req.prompt_tokens, req.chat_text, sampling)
        sampler = self._make_sampler(sampling, handle.seed, budget)
        if req.wants_drawn_probabilities and not isinstance(sampler, ChainSampler):
            sampler = ChainSampler(self._lc, sampler, self._n_vocab)  # the same draws, its candidates kept
        seq = _Sequence(handle, slot, limit, sampler, StopText(stops), lines=LineState(req.lines or LineLimits()),
                        task=self._requests_admitted)
        self._requests_admitted += 1
        feed_prompt(self._lc, seq.sampler, req.prompt_tokens)
        keep = common_prefix(self._kept[slot], req.prompt_tokens) if req.cache_prompt else 0
        seq.n_past = seq.n_cached = max(0, min(keep, len(req.prompt_tokens) - 1))
        self._kept[slot] = []
        with self._lock:
            self._slots[slot] = seq
            self._last[slot] = seq
            self._cached_tokens += seq.n_cached
        self._lc.llama_memory_seq_rm(self._mem, slot, seq.n_past, -1)
        if self.engine.placement is not None:
            self.engine.placement.reset_sequence(slot)
        if self._prompt_cache is not None:
            for other in idle:
                if self._save_cells(other):
                    self._prompt_cache.update()

    def _save_cells(self, slot: int) -> bool:
        """The cells ``slot`` kept into the prompt cache (llama-server's ``prompt_save``); False
        where it makes no entry (none kept, held already, over the limit)."""
        kept, lc = self._kept[slot], self._lc
        if not kept:
            return False
        size = int(lc.llama_state_seq_get_size_ext(self._ctx, slot, 0))
        entry = self._prompt_cache.alloc(kept, size)
        if entry is None:
            return False
        n = lc.llama_state_seq_get_data_ext(self._ctx, entry.data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                            size, slot, 0)
        if n != size:  # llama.cpp could not write the state: keep no half entry
            self._prompt_cache.remove(entry)
            return False
        return True

    def _load_cells(self, slot: int, prompt: list[int]) -> bool:
        """Into ``slot``, the cached prompt that serves ``prompt`` better than its own cells, if
        any (llama-server's ``prompt_load``); False where llama.cpp could not restore it."""
        entry = self._prompt_cache.best(self._kept[slot], prompt)
        if entry is None:
            return True
        n = self._lc.llama_state_seq_set_data_ext(self._ctx, entry.data.ctypes.data_as(
            ctypes.POINTER(ctypes.c_uint8)), entry.size, slot, 0)
        self._prompt_cache.remove(entry)
        if n != entry.size:
            return False
        self._kept[slot] = entry.tokens
        return True

    def _prefill(self, seq: _Sequence) -> None:
        """Evaluate the next ubatch of ``seq``'s prompt (``-ub`` tokens from where the last one
        ended, with logits for its last token: the ubatches ``Engine.generate`` evaluates, so
        the cells are the same); after the last one, sample the first token. One ubatch per
        step keeps a long prompt from stalling the sequences already decoding."""
        toks = seq.handle.request.prompt_tokens
        chunk = toks[seq.n_past:seq.n_past + self._n_ubatch]
        self._fill([(seq.slot, t, seq.n_past + j, j == len(chunk) - 1) for j, t in enumerate(chunk)])
        if not self._decode([seq]):
            return
        if self.engine.placement is not None:
            self.engine.placement.on_prompt(len(chunk))
        seq.n_past += len(chunk)
        if seq.n_past < len(toks):
            return
        if seq.limit == 0:  # n_predict 0: the prompt is evaluated, nothing generated
            self._finish(seq, "length", b"")
            return
        self._take_sample(seq, len(chunk) - 1)

    def _make_sampler(self, sampling: SamplingConfig, seed: int, budget=None):
        """``sampling``'s chain with ``seed``, as llama-cpp-python builds it for ``generate``
        (Engine._steps), or llama.cpp's common chain where ``sampling.server_chain``
        (samplers.server_sampler), with a chat's reasoning budget (thinking.ReasoningBudget) or None; a
        grammar is checked after the chain and applied only where its token breaks it, as
        llama-server samples (grammar.ChainSampler's ``grammar_last``)."""
        from llama_cpp.llama_grammar import LlamaGrammar  # llama_cpp is loaded: the engine is

        llm = self.engine.llm
        if sampling.server_chain:
            return server_sampler(self._lc, self._vocab, self._n_vocab, sampling,
                                  sampling.chain_logit_bias(self.engine.eog_tokens), seed, budget)
        saved = llm._seed, llm.last_n_tokens_size, llm._saem_logit_bias, llm._saem_budget, llm._saem_grammar_last
        try:
            llm.set_seed(seed)
            llm.last_n_tokens_size = sampling.repeat_last_n
            llm._saem_logit_bias = sampling.chain_logit_bias(self.engine.eog_tokens)
            llm._saem_budget = budget
            llm._saem_grammar_last = True  # a grammar as llama-server samples with it
            return llm._init_sampler(
                top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p, typical_p=sampling.typical_p,
                temp=max(sampling.temp, 0.0), repeat_penalty=sampling.repeat_penalty,
                frequency_penalty=sampling.frequency_penalty, presence_penalty=sampling.presence_penalty,
                grammar=None if sampling.grammar is None else LlamaGrammar.from_string(sampling.grammar))
        finally:
            llm._seed, llm.last_n_tokens_size, llm._saem_logit_bias, llm._saem_budget, llm._saem_grammar_last = saved

    def _fill(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """Load (sequence id, token, position, logits wanted) rows into the llama_batch."""
        b = self._batch
        for i, (seq_id, tok, pos, logits) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_id
            b.logits[i] = logits
        b.n_tokens = len(rows)

    def _decode(self, seqs: list[_Sequence]) -> bool:
        """Decode the filled batch (tokens of ``seqs``); on failure those sequences end with
        "error" (the others go on) and False is returned. In a shared KV stream (-kvu) a batch
        that finds no free cells is decoded again once the free slots' kept cells are cleared
        (saved to the prompt cache first), as llama-server does; where none are kept, the context
        is full: "Context size has been exceeded." as llama-server says it. (A batch is one
        ubatch here, so a failed one left no cells behind.)"""
        rc = self._lc.llama_decode(self._ctx, self._batch)
        if rc == 1 and self._unified and self._clear_idle_slots():
            rc = self._lc.llama_decode(self._ctx, self._batch)
        if rc == 0:
            return True
        n = self._batch.n_tokens
        error = "Context size has been exceeded." if rc == 1 and self._unified else \
            f"llama_decode failed (code {rc}) on a batch of {n} tokens"
        for s in seqs:
            self._finish(s, "error", b"", error=error)
        return False

    def _clear_idle_slots(self) -> bool:
        """The cells the free slots kept, into the prompt cache where it takes them, then out of
        the KV cache (llama-server's ``try_clear_idle_slots``); False where none were kept."""
        cleared = False
        for slot, seq in enumerate(self._slots):
            if seq is None and self._kept[slot]:
                if self._prompt_cache is not None and self._save_cells(slot):
                    self._prompt_cache.update()
                self._lc.llama_memory_seq_rm(self._mem, slot, -1, -1)
                self._kept[slot] = []
                cleared = True
        return cleared

    def _decode_step(self) -> None:
        """A prompt ubatch of every sequence still prefilling, then one token of every sequence
        decoding: decode, sample, release, retire, place."""
        for s in self._slots:
            if s is not None and s.n_past < s.n_prompt:
                self._prefill(s)
        active = [s for s in self._slots if s is not None and s.next_token is not None]
        if not active:
            return
        placement = self.engine.placement
        with self._lock:
            self._steps += 1
            self._rows += len(active)
        routing_runs, pieces, slots = [], [], []  # of the rows decoded, for placement
        runs = list(_consecutive_runs(active, self._n_ubatch, self._unified))
        with self._lock:
            self._step_decodes += len(runs)
        for run in runs:
            self._fill([(s.slot, s.next_token, s.n_past, True) for s in run])
            if not self._decode(run):
                continue
            if placement is not None:
                routing_runs.append(placement.last_routing())
                pieces += [self.engine.piece(s.next_token) for s in run]
                slots += [s.slot for s in run]
            for i, s in enumerate(run):
                s.n_past += 1
                self._take_sample(s, i)
        if routing_runs:
            placement.on_step(np.concatenate(routing_runs, axis=0), pieces, slots)

    def _take_sample(self, seq: _Sequence, batch_index: int) -> None:
        """Sample ``seq``'s next token from the logits of batch row ``batch_index`` and release
        what it adds; the sequence ends at end of generation, a stop string or its limit."""
        lc = self._lc
        if seq.t_first is None:
            seq.t_first = time.perf_counter()
        try:  # a LlamaSampler, or a ChainSampler (a grammar, a reasoning budget or post_sampling_probs)
            tok = seq.sampler.sample(self._llama_ctx, batch_index)
        except GrammarDeadEnd:  # nothing was accepted: the text so far stands
            self._finish(seq, "stop", seq.text.flush())
            return
        seq.n_sampled += 1
        req = seq.handle.request
        if req.wants_drawn_probabilities:
            logprobs = (seq.sampler.drawn_probabilities(min(req.n_probs, self._n_vocab)),)
        else:
            logprobs = self._logprobs(batch_index, tok, req.n_probs)
        if lc.llama_vocab_is_eog(self._vocab, tok):
            # llama-server checks the indentation on this token too (its text is empty)
            keep = seq.lines.indent_cut(seq.text.text)
            self._finish(seq, "stop", seq.text.flush(), keep=keep)
            return
        seq.tokens.append(tok)
        with self._lock:
            self._tokens += 1
        last = len(seq.tokens) >= seq.limit
        piece, stopped = seq.text.add(self.engine._piece_after(seq.tokens), last)
        # after the stop strings and the length, as llama-server checks them
        keep = seq.lines.indent_cut(seq.text.text)
        late = seq.lines.out_of_time(piece, (time.perf_counter() - seq.t_first) * 1e3)
        limited = keep is not None or late  # a limit, even where a stop string also ended it (as there)
        if stopped or last or limited:
            self._finish(seq, "stop" if stopped and not limited else "length", piece, (tok,), logprobs, keep=keep)
            return
        seq.next_token = tok
        seq.handle._push(TokenEvent(piece, (tok,), logprobs, None, cached=seq.n_cached), self._step_wakes)

    def _logprobs(self, batch_index: int, tok: int, n_probs: int) -> tuple | None:
        """(chosen token's logprob, its n_probs best alternatives, best first), from the raw
        logits with llama-cpp-python's own ``Llama.logits_to_logprobs`` and its order (logprob
        descending, then token id descending: ``sorted(zip(logprobs, ids), reverse=True)``)."""
        if n_probs <= 0:
            return None
        n_probs = min(n_probs, self._n_vocab)  # a request may ask for more (llama-server: all there are)
        ptr = self._lc.llama_get_logits_ith(self._ctx, batch_index)
        lp = self.engine.llm.logits_to_logprobs(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)))
        cut = np.partition(lp, lp.size - n_probs)[lp.size - n_probs]  # the n_probs-th best value
        best = np.flatnonzero(lp >= cut)  # ties at the cut included, then ordered as llama-cpp-python
        best = best[np.lexsort((-best, -lp[best]))][:n_probs]
        return ((float(lp[tok]), tuple((int(t), float(lp[t])) for t in best)),)

    def _finish(self, seq: _Sequence, reason: str, text: bytes, token_ids: tuple[int, ...] = (),
                logprobs: tuple | None = None, error: str | None = None, keep: int | None = None) -> None:
        """End ``seq``: free its slot and KV cells, then push its final event."""
        seq.ended = True
        try:
            # the cells stay for the next request on this slot that shares their beginning (also
            # after one that did not use the cache, as llama-server's), unless it was cancelled or
            # failed (then nothing is known of them)
            cells = seq.handle.request.prompt_tokens + seq.tokens
            kept = cells[:seq.n_past] if reason in ("stop", "length") else []
            self._kept[seq.slot] = kept
            self._uses += 1
            self._last_used[seq.slot] = self._uses
            self._lc.llama_memory_seq_rm(self._mem, seq.slot, len(kept), -1)
            seq.sampler.close()
        finally:
            seq.next_token = None
            with self._lock:
                self._slots[seq.slot] = None
            now = time.perf_counter()
            first = seq.t_first if seq.t_first is not None else now
            hit = seq.text.hit
            seq.handle._push(TokenEvent(text, token_ids, logprobs, reason, error,
                                        usage=(seq.n_prompt, len(seq.tokens)), cached=seq.n_cached,
                                        stop_word=None if hit is None else hit.decode("utf-8", "replace"),
                                        timings=(first - seq.t_admitted, now - first), keep=keep),
                        self._step_wakes)


def _set_all(flags: list[asyncio.Event]) -> None:
    for flag in flags:
        flag.set()


def _wake_loops(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    """Set each waiting consumer's flag, with one thread-safe call per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for loop, flag in waiters:
        by_loop.setdefault(loop, []).append(flag)
    for loop, flags in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, flags)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass


def _consecutive_runs(active: list[_Sequence], n_ubatch: int, unified: bool = False) -> Iterator[list[_Sequence]]:
    """``active`` (in slot order) split where slot ids are not consecutive and every ``n_ubatch``:
    the ubatches llama.cpp would make of the step's batch with one KV stream per sequence; in a
    shared stream (``unified``) only every ``n_ubatch`` (llama.cpp's split_simple)."""
    run: list[_Sequence] = []
    for s in active:
        if run and ((s.slot != run[-1].slot + 1 and not unified) or len(run) == n_ubatch):
            yield run
            run = []
        run.append(s)
    if run:
        yield run
