"""The continuous-batching scheduler (saem_gguf.serving.batch) on real generated models: a reply
does not depend on what else is in the batch, nor on the policy or cache size; cancellation,
the bounded queue and the context limit behave; every accepted request ends exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Iterator

import numpy as np
import pytest

from conftest import spec_for
from fidelity_helpers import make_eot_model, model_for
from saem_gguf.engine import Engine, EngineConfig, SamplingConfig
from saem_gguf.errors import SaemError
from saem_gguf.serving.batch import (
    BatchRequest, PromptTooLong, QueueFull, Scheduler, SchedulerStopped, SequenceHandle, TokenEvent, common_prefix,
)
from saem_gguf.testmodels import ensure_model

PROMPTS = ["First, compute 12 + 7. Wait, let me verify the sum.", "Hello there",
           "Alternatively, count up from 12 to 30 and then", "The quick brown fox",
           "a b c d e f g", "Let me think step by step about this problem", "x", "Therefore the answer is"]
# different lengths, so sequences leave at different steps and waiting ones join mid-flight
MAX_TOKENS = [24, 9, 17, 30, 5, 21, 12, 26]
N_CTX_SEQ = 256


@pytest.fixture(scope="module")
def qwen3_path(llama_cpp):
    return ensure_model(spec_for("qwen3moe", "q4_0", n_expert=16, n_expert_used=4, n_layer=3, seed=2))


def load(path, n_parallel: int, policy: str = "saem", ecr: float = 0.25, **kw) -> Engine:
    return Engine(EngineConfig(model=path, n_ctx=N_CTX_SEQ * n_parallel, n_parallel=n_parallel,
                               policy=policy, ecr=ecr, n_threads=2, **kw))


@contextlib.contextmanager
def serving(path, n_parallel: int, policy: str = "saem", ecr: float = 0.25, queue_max: int = 64,
            start: bool = True, engine: Engine | None = None, **kw) -> Iterator[tuple[Engine, Scheduler]]:
    """(engine, scheduler) of ``n_parallel`` slots on ``path`` (or on ``engine``); on the way out
    the scheduler stops (cancelling what is left, so no decode thread outlives its engine) and
    the engine closes."""
    eng = engine or load(path, n_parallel, policy, ecr, **kw)
    try:
        sched = Scheduler(eng, n_parallel, queue_max)
        if start:
            sched.start()
        try:
            yield eng, sched
        finally:
            sched.stop(drain=False)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def alone(qwen3_path):
    """Each prompt's greedy reply served alone by Engine.generate on a one-sequence context."""
    eng = load(qwen3_path, 1, policy="cpu-moe", ecr=0.0)
    try:
        return [eng.generate(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    finally:
        eng.close()


def collect(handle: SequenceHandle, timeout: float = 60) -> list[TokenEvent]:
    evs = list(handle.events(timeout=timeout))
    assert [e.finish_reason is not None for e in evs].count(True) == 1 and evs[-1].finish_reason is not None
    return evs


def reply(evs: list[TokenEvent]) -> tuple[list[int], bytes, str]:
    return ([t for e in evs for t in e.token_ids], b"".join(e.text for e in evs), evs[-1].finish_reason)


def serve_all(sched: Scheduler, reqs: list[BatchRequest], gap_s: float = 0.0) -> list[list[TokenEvent]]:
    handles = []
    for r in reqs:
        handles.append(sched.submit(r))
        time.sleep(gap_s)
    return [collect(h) for h in handles]


@pytest.mark.parametrize("policy,ecr", [("saem", 0.125), ("saem", 0.5), ("lru-cpu", 0.125), ("lru-cpu", 0.5)])
def test_greedy_reply_in_a_batch_equals_the_reply_served_alone(qwen3_path, alone, policy, ecr):
    with serving(qwen3_path, 4, policy, ecr) as (eng, sched):
        reqs = [BatchRequest(eng.prompt_tokens(p), n, SamplingConfig()) for p, n in zip(PROMPTS, MAX_TOKENS)]
        out = serve_all(sched, reqs, gap_s=0.003)  # staggered: later ones arrive mid-step
        sched.stop(drain=True)  # the last step's placement runs after its final events went out
        st = sched.stats()
    for i, (evs, ref) in enumerate(zip(out, alone)):
        toks, text, reason = reply(evs)
        assert toks == ref.tokens, f"request {i}: tokens differ from the reply served alone"
        assert text.decode("utf-8", "ignore") == ref.text and reason == ref.finish_reason
        assert evs[-1].usage == (len(ref.prompt_token_ids), len(ref.tokens))
    # every decoded token's routing reached placement, one row per sequence per step
    # a reply cut by its limit ends with a token that is sampled, never decoded
    decoded = sum(len(r.tokens) - (r.finish_reason == "length") for r in alone)
    assert st["requests"] == len(PROMPTS) and st["busy_slots"] == 0 and st["queue_len"] == 0
    assert st["expert_accesses"] == decoded * 3 * 4
    assert st["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in alone)


def test_eight_at_once_equal_alone_and_one_slot_equals_eight(qwen3_path, alone):
    """All eight prompts in the batch together, and the same requests on a single slot."""
    for n_parallel in (8, 1):
        with serving(qwen3_path, n_parallel, start=False) as (eng, sched):
            reqs = [BatchRequest(eng.prompt_tokens(p), n, SamplingConfig()) for p, n in zip(PROMPTS, MAX_TOKENS)]
            handles = [sched.submit(r) for r in reqs]  # queued before the loop starts: one batch of 8
            sched.start()
            out = [collect(h) for h in handles]
        assert [reply(evs)[0] for evs in out] == [r.tokens for r in alone], f"-np {n_parallel}"


def same_schedule(path, policy: str, ecr: float) -> list[list[tuple]]:
    """Every token's logprobs (the chosen one's and the 3 best) of the eight prompts on -np 4,
    all queued before the loop starts: which rows share a step depends on the replies alone."""
    with serving(path, 4, policy, ecr, start=False) as (eng, sched):
        handles = [sched.submit(BatchRequest(eng.prompt_tokens(p), n, SamplingConfig(), n_probs=3))
                   for p, n in zip(PROMPTS, MAX_TOKENS)]
        sched.start()
        return [[lp for e in collect(h) for lp in e.logprobs or ()] for h in handles]


def test_same_schedule_gives_bit_identical_logits_under_every_policy_and_cache_size(qwen3_path):
    """The hard rule in a batch: placement never changes a bit of the logits (on CPU)."""
    ref = same_schedule(qwen3_path, "cpu-moe", 0.0)
    for policy, ecr in (("saem", 0.125), ("lru-cpu", 0.5)):
        assert same_schedule(qwen3_path, policy, ecr) == ref, f"{policy} at ECR {ecr}"


def test_prompts_prefilled_in_small_ubatches_between_steps_equal_alone(qwen3_path):
    """-ub 8: a prompt takes several steps to evaluate while others decode; the cells (and so
    the reply) are those of Engine.generate's ubatches."""
    small = dict(n_batch=8, n_ubatch=8)
    eng = load(qwen3_path, 1, **small)
    try:
        ref = [eng.generate(p, n).tokens for p, n in zip(PROMPTS, MAX_TOKENS)]
    finally:
        eng.close()
    with serving(qwen3_path, 3, **small) as (eng, sched):
        out = serve_all(sched, [BatchRequest(eng.prompt_tokens(p), n, SamplingConfig())
                                for p, n in zip(PROMPTS, MAX_TOKENS)], gap_s=0.003)
        sched.stop(drain=True)
        st = sched.stats()
    assert [reply(evs)[0] for evs in out] == ref
    assert st["prompt_tokens"] == sum(evs[-1].usage[0] for evs in out)


def test_cancel_frees_the_slot_and_its_cells_at_once(qwen3_path):
    with serving(qwen3_path, 1) as (eng, sched):
        lc, mem = eng._llama_cpp, eng._llama_cpp.llama_get_memory(eng.llm.ctx)
        long = sched.submit(BatchRequest(eng.prompt_tokens(PROMPTS[0]), 200, SamplingConfig()))
        events = long.events(timeout=60)
        assert next(events).finish_reason is None  # generating
        waiting = sched.submit(BatchRequest(eng.prompt_tokens(PROMPTS[1]), 4, SamplingConfig()))
        long.cancel()
        rest = list(events)
        assert rest[-1].finish_reason == "cancelled" and rest[-1].usage[1] < 200
        assert [e.finish_reason for e in rest].count("cancelled") == 1
        done = collect(waiting)  # the freed slot serves the next request
        assert done[-1].finish_reason == "length" and done[-1].usage[1] == 4
        # the cancelled request's cells are gone; the next one's stay (the prompt cache)
        assert lc.llama_memory_seq_pos_max(mem, 0) == len(eng.prompt_tokens(PROMPTS[1])) + 4 - 2
        assert sched.stats()["busy_slots"] == 0
        long.cancel()  # a second cancel of an ended request changes nothing


def test_a_request_starts_from_the_cells_its_slot_kept(qwen3_path, alone):
    """cache_prompt: a finished request's cells stay in its slot; the next request goes to the
    free slot whose cells share most of its prompt's beginning, evaluates only the rest (at least
    its last token) and gives the tokens it gives alone; cache_prompt off evaluates it all."""
    with serving(qwen3_path, 2, start=False) as (eng, sched):
        lc, mem = eng._llama_cpp, eng._llama_cpp.llama_get_memory(eng.llm.ctx)
        prompts = [eng.prompt_tokens(p) for p in PROMPTS[:3]]
        first = [sched.submit(BatchRequest(prompts[i], MAX_TOKENS[i], SamplingConfig())) for i in (0, 1)]
        sched.start()  # both admitted in one pass, each to the least recently used slot, the last of equals
        assert [collect(h)[-1].cached for h in first] == [0, 0] and [h.slot for h in first] == [1, 0]
        kept = [len(prompts[i]) + MAX_TOKENS[i] - 1 for i in (0, 1)]
        assert [lc.llama_memory_seq_pos_max(mem, s) for s in (1, 0)] == [kept[0] - 1, kept[1] - 1]
        h = sched.submit(BatchRequest(prompts[1], MAX_TOKENS[1], SamplingConfig()))
        again = collect(h)
        assert h.slot == 0 and again[-1].cached == len(prompts[1]) - 1  # its slot's cells; the last token evaluated
        assert sched.stats()["prompt_tokens_cached"] == len(prompts[1]) - 1
        assert reply(again)[0] == alone[1].tokens
        assert lc.llama_memory_seq_pos_max(mem, 1) == kept[0] - 1  # the other slot untouched
        fresh = collect(sched.submit(BatchRequest(prompts[1], MAX_TOKENS[1], SamplingConfig(), cache_prompt=False)))
        assert fresh[-1].cached == 0 and reply(fresh)[0] == alone[1].tokens
        other = collect(sched.submit(BatchRequest(prompts[2], MAX_TOKENS[2], SamplingConfig())))
        assert other[-1].cached == 0 and reply(other)[0] == alone[2].tokens


@pytest.mark.parametrize("a,b", [([], []), ([1, 2, 3], [1, 2, 3]), ([1, 2, 3], [1, 2]), ([1, 2], [1, 2, 3]),
                                 ([1, 2, 3], [1, 5, 3]), ([4], [1]), ([], [1])])
def test_common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix(a, b) == n


def test_queue_full_prompt_too_long_and_stop_without_drain(qwen3_path):
    with serving(qwen3_path, 1, queue_max=1, start=False) as (eng, sched):
        with pytest.raises(PromptTooLong):
            sched.submit(BatchRequest([1] * eng.n_ctx_seq, 8, SamplingConfig()))
        with pytest.raises(SaemError, match="not in the vocabulary"):
            sched.submit(BatchRequest([1, eng.llm.n_vocab()], 8, SamplingConfig()))
        with pytest.raises(SaemError, match="seed"):
            sched.submit(BatchRequest([1], 8, SamplingConfig(seed=2**40)))
        fits = sched.submit(BatchRequest([1] * (eng.n_ctx_seq - 1), 8, SamplingConfig()))  # room for one token
        fits.cancel()  # still waiting: it ends at once and leaves the queue
        assert [e.finish_reason for e in collect(fits)] == ["cancelled"]
        short = BatchRequest(eng.prompt_tokens("Hello"), 8, SamplingConfig())
        first, second = sched.submit(short), sched.submit(short)  # one slot + one waiting
        with pytest.raises(QueueFull):
            sched.submit(short)
        sched.stop(drain=False)
        for h in (first, second):
            assert [e.finish_reason for e in collect(h)] == ["cancelled"]
        with pytest.raises(SchedulerStopped):
            sched.submit(short)


def test_every_accepted_request_ends_exactly_once_under_cancel_and_shutdown(qwen3_path):
    with serving(qwen3_path, 3, queue_max=16) as (eng, sched):
        handles = [sched.submit(BatchRequest(eng.prompt_tokens(p), 40, SamplingConfig())) for p in PROMPTS]
        handles[1].cancel()
        handles[6].cancel()  # still waiting
        time.sleep(0.05)
        sched.stop(drain=False)
        reasons = [collect(h)[-1].finish_reason for h in handles]
    assert reasons[1] == reasons[6] == "cancelled"
    assert set(reasons) <= {"cancelled", "length", "stop"}
    assert all(not h._events for h in handles)  # nothing after the final event


def test_seeded_sampling_is_reproducible_and_equals_generate(qwen3_path):
    hot = SamplingConfig(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    eng = load(qwen3_path, 3)
    ref = eng.generate(PROMPTS[0], 20, hot).tokens
    with serving(qwen3_path, 3, engine=eng) as (eng, sched):
        reqs = [BatchRequest(eng.prompt_tokens(PROMPTS[0]), 20, hot),
                BatchRequest(eng.prompt_tokens(PROMPTS[3]), 20, SamplingConfig(temp=1.0, seed=7)),
                BatchRequest(eng.prompt_tokens(PROMPTS[0]), 20, hot)]
        handles = [sched.submit(r) for r in reqs]
        assert handles[0].seed == 1234 and handles[1].seed == 7
        a, _, b = [collect(h) for h in handles]
        unseeded = serve_all(sched, [BatchRequest(eng.prompt_tokens(PROMPTS[0]), 20,
                                                  SamplingConfig(temp=1.0, top_k=0, top_p=1.0, min_p=0.0))] * 2)
    assert reply(a)[0] == reply(b)[0] == ref
    assert reply(unseeded[0])[0] != reply(unseeded[1])[0]  # seed None: a random one per request


def test_stop_strings_as_generate_applies_them(qwen3_path, alone):
    text = alone[0].text
    cut = text[len(text) // 2:len(text) // 2 + 3]  # a stop string from the middle of the reply
    assert cut and len(cut.encode()) == 3
    eng = load(qwen3_path, 2)
    ref = eng.generate(PROMPTS[0], MAX_TOKENS[0], SamplingConfig(stop=("never appears", cut)))
    with serving(qwen3_path, 2, engine=eng) as (eng, sched):
        sampling = SamplingConfig(stop=("never appears",))
        evs, _ = serve_all(sched, [BatchRequest(eng.prompt_tokens(PROMPTS[0]), MAX_TOKENS[0], sampling,
                                                extra_stops=(cut,)),
                                   BatchRequest(eng.prompt_tokens(PROMPTS[2]), 30, SamplingConfig())])
    toks, out, reason = reply(evs)
    assert reason == ref.finish_reason == "stop"
    assert out.decode() == ref.text and cut not in ref.text and ref.text == text[:text.index(cut)]
    assert toks == ref.tokens


def test_logprobs_are_llama_cpp_pythons(qwen3_path):
    """n_probs: each token's logprob and the best alternatives, as create_completion(logprobs=3)
    reports the first token's (its logits_all context computes the prompt's last layer over all
    rows, so the values agree to rounding, not bit for bit)."""
    ref_eng = load(qwen3_path, 1, record=True)  # record: logits_all, which create_completion's logprobs need
    try:
        ref = ref_eng.llm.create_completion(PROMPTS[0], max_tokens=1, temperature=0.0, logprobs=3)
        ref_top = ref["choices"][0]["logprobs"]["top_logprobs"][0]
    finally:
        ref_eng.close()
    with serving(qwen3_path, 1) as (eng, sched):
        (evs,) = serve_all(sched, [BatchRequest(eng.prompt_tokens(PROMPTS[0]), 6, SamplingConfig(), n_probs=3)])
        names = {t: eng.llm.detokenize([t]).decode("utf-8", "ignore") for e in evs for _, top in e.logprobs or ()
                 for t, _ in top}
    chosen, top = evs[0].logprobs[0]
    assert {names[t]: lp for t, lp in top} == pytest.approx(ref_top, abs=1e-4)
    for e in evs:
        for tok, (chosen, top) in zip(e.token_ids, e.logprobs):
            assert len(top) == 3 and top[0] == (tok, chosen)  # greedy picks the best
            assert chosen <= 0 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_end_of_generation_and_ignore_eos_as_generate(tmp_path):
    """A model whose greedy first answer token is <end_of_turn> (an EOG token that is not EOS)."""
    model, question = make_eot_model(tmp_path, model_for("qwen3moe", "gemma", True))
    eng = load(model, 2)
    chat = eng.chat_prompt(question)
    ignoring = SamplingConfig(ignore_eos=True)
    ref_stop, ref_ignore = eng.generate(chat, 8), eng.generate(chat, 8, ignoring)
    with serving(model, 2, engine=eng) as (eng, sched):
        stop, ignore = serve_all(sched, [BatchRequest(chat.tokens, 8, SamplingConfig(), extra_stops=chat.stop),
                                         BatchRequest(chat.tokens, 8, ignoring, extra_stops=chat.stop)])
    assert ref_stop.tokens == [] and ref_stop.finish_reason == "stop"
    assert reply(stop) == ([], b"", "stop") and stop[-1].usage == (len(chat.tokens), 0)
    assert reply(ignore)[0] == ref_ignore.tokens and len(ref_ignore.tokens) == 8
    assert reply(ignore)[2] == ref_ignore.finish_reason == "length"


def test_async_consumers_get_the_same_events(qwen3_path, alone):
    """aevents, as the server's event loop reads them: several requests awaited concurrently."""

    async def consume(handle: SequenceHandle) -> list[TokenEvent]:
        return [ev async for ev in handle.aevents()]

    async def main(eng: Engine, sched: Scheduler) -> list[list[TokenEvent]]:
        handles = [sched.submit(BatchRequest(eng.prompt_tokens(p), n, SamplingConfig()))
                   for p, n in zip(PROMPTS[:5], MAX_TOKENS[:5])]
        return await asyncio.wait_for(asyncio.gather(*(consume(h) for h in handles)), 60)

    with serving(qwen3_path, 4) as (eng, sched):
        out = asyncio.run(main(eng, sched))
    for evs, ref in zip(out, alone):
        assert [e.finish_reason is not None for e in evs].count(True) == 1
        assert reply(evs)[0] == ref.tokens and reply(evs)[1].decode("utf-8", "ignore") == ref.text


def test_dense_model_batches_with_placement_off(llama_cpp):
    path = ensure_model(spec_for("llama", "f16", dense=True))
    eng = Engine(EngineConfig(model=path, n_ctx=N_CTX_SEQ * 3, n_parallel=3, n_threads=2))
    assert eng.placement is None
    ref = [eng.generate(p, 10).tokens for p in PROMPTS[:3]]
    with serving(path, 3, engine=eng) as (eng, sched):
        out = serve_all(sched, [BatchRequest(eng.prompt_tokens(p), 10, SamplingConfig()) for p in PROMPTS[:3]])
        assert sched.stats()["policy"] == "off"
    assert [reply(evs)[0] for evs in out] == ref


def test_on_step_counts_every_row_and_detects_stages_per_sequence(qwen3_path):
    """Placement.on_step on a two-row step: accesses and tokens per row, a cue written by one
    sequence is that sequence's boundary (the other, fed plain text, raises none)."""
    eng = load(qwen3_path, 2)
    try:
        p = eng.placement
        routing = np.tile(np.arange(p.top_k, dtype=np.int16), (2, len(p.moe_layers), 1))
        events = []
        # past the detector's minimum stage length, then "Alternatively," opening a sentence in row 0
        texts = [(b" one", b" two")] * 40 + [(b" ok.", b" ok"), (b" Alternatively", b" so"), (b",", b" on"),
                                              (b" try", b" and")]
        for a, b in texts:
            events += p.on_step(routing, [a, b], [0, 1])
        assert [(e.seq, e.cue) for e in events] == [(0, "Alternatively")]
        assert p.stats.tokens == 2 * len(texts) and p.stats.boundaries == 1
        assert p.stats.accesses == 2 * len(texts) * len(p.moe_layers) * p.top_k
    finally:
        eng.close()


@pytest.mark.slow
def test_soak_random_arrivals_lengths_and_cancels(qwen3_path):
    """64 requests at random gaps, lengths and prompts on -np 8, a quarter cancelled at random
    moments: each ends exactly once, and every reply that was not cancelled equals the reply
    served alone."""
    rng = np.random.default_rng(13)
    picks = [(int(rng.integers(len(PROMPTS))), int(rng.integers(1, 40))) for _ in range(64)]
    eng = load(qwen3_path, 1, policy="cpu-moe", ecr=0.0)
    try:
        ref = {pick: eng.generate(PROMPTS[pick[0]], pick[1]).tokens for pick in set(picks)}
    finally:
        eng.close()
    with serving(qwen3_path, 8, "saem", 0.125, queue_max=64) as (eng, sched):
        handles = []
        for i, (p, n) in enumerate(picks):
            handles.append(sched.submit(BatchRequest(eng.prompt_tokens(PROMPTS[p]), n, SamplingConfig())))
            time.sleep(float(rng.uniform(0, 0.004)))
            if i % 4 == 3:
                handles[int(rng.integers(len(handles)))].cancel()
        out = [collect(h) for h in handles]
    for pick, evs in zip(picks, out):
        toks, _, reason = reply(evs)
        if reason == "cancelled":
            assert toks == ref[pick][:len(toks)]  # what it got before the cancel is the reply's start
        else:
            assert toks == ref[pick]


def test_parallel_settings_are_checked(qwen3_path):
    for bad in (0, 257):
        with pytest.raises(SaemError, match="n_parallel"):
            EngineConfig(model=qwen3_path, n_parallel=bad)
    eng = load(qwen3_path, 2)
    try:
        assert eng.n_ctx_seq == N_CTX_SEQ and eng.llm.n_ctx() == 2 * N_CTX_SEQ  # -c split per sequence
        with pytest.raises(SaemError, match="n_parallel >= 3"):
            Scheduler(eng, 3)
        with pytest.raises(SaemError, match="queue_max"):
            Scheduler(eng, 2, queue_max=-1)
    finally:
        eng.close()


def test_warm_up_runs_every_slot_then_leaves_nothing_behind(qwen3_path, alone):
    """serve's warm-up run (Scheduler.start(warm_up=...)): before start() returns, the decode
    thread decodes in every slot, then the slots and their KV cells are empty, every count is
    zero, and the replies served after are the ones served alone; a request queued before start
    waits for it."""
    with serving(qwen3_path, 4, start=False) as (eng, sched):
        lc, ctx = eng._llama_cpp, eng.llm.ctx
        mem = lc.llama_get_memory(ctx)
        reqs = [BatchRequest(eng.prompt_tokens(p), n, SamplingConfig()) for p, n in zip(PROMPTS, MAX_TOKENS)]
        first = sched.submit(reqs[0])
        decode_thread = []
        real_warm_up = sched._warm_up
        sched._warm_up = lambda tokens: (decode_thread.append(threading.current_thread()), real_warm_up(tokens))
        sched.start(warm_up=eng.prompt_tokens("Hello"))
        assert decode_thread == [sched._thread]  # not the caller's thread (see Scheduler.start)
        assert lc.llama_perf_context(ctx).n_eval > 0  # it decoded (llama.cpp's own count)
        out = [collect(first)]
        # the warm-up left nothing; the request keeps its cells for the next (cache_prompt): its
        # prompt and the tokens it decoded, all but the last it sampled
        kept = len(alone[0].prompt_token_ids) + len(alone[0].tokens) - 1
        assert [lc.llama_memory_seq_pos_max(mem, s) for s in range(4)] == [-1, -1, -1, kept - 1]  # (slot 3: LRU)
        st = sched.stats()
        assert (st["busy_slots"], st["tokens"], st["requests"]) == (0, len(alone[0].tokens), 1)
        assert st["prompt_tokens"] == len(alone[0].prompt_token_ids)  # the warm-up's are not counted
        out += serve_all(sched, reqs[1:])
    assert [reply(evs)[0] for evs in out] == [r.tokens for r in alone]


def test_a_failed_warm_up_fails_start_with_one_line(qwen3_path):
    with serving(qwen3_path, 2, start=False) as (eng, sched):
        def broken(tokens: list[int]) -> None:
            raise MemoryError("out of memory\nwhile warming up")

        sched._warm_up = broken
        with pytest.raises(SaemError, match=r"^the server's warm-up run failed: .*MemoryError: out of memory$"):
            sched.start(warm_up=eng.prompt_tokens("x"))
        with pytest.raises(SchedulerStopped):
            sched.submit(BatchRequest(eng.prompt_tokens("x"), 2, SamplingConfig()))
