"""Routing counters read from a graph output (no eval callback) equal the top-k ids that the eval
callback sees in the same run - with and without a cache, for prompt and decode ubatches."""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest

from native_helpers import (NATIVE_ARCHS, PROMPT, Runner, TopkObserver, layer_infos, random_fill,
                            spec)
from saem_gguf import native_api as na
from saem_gguf.policies.state import step_uses
from saem_gguf.testmodels import ensure_model


def _hist(ids: np.ndarray, n_expert: int) -> list[int]:
    return np.bincount(ids.reshape(-1), minlength=n_expert).tolist()


@pytest.mark.parametrize("arch", NATIVE_ARCHS)
@pytest.mark.parametrize("with_cache", [False, True])
def test_counts_match_eval_callback(arch, with_cache):
    obs = TopkObserver()
    path = ensure_model(spec(arch, "q8_0", n_expert=16, n_expert_used=4, n_layer=3))
    with Runner(path, observer=obs, n_ubatch=8, n_batch=64) as r:
        ctx = r.ctx
        infos = [i for i in layer_infos(ctx) if i.n_expert > 0]
        assert na.saem_moe_get_counting(ctx) == na.SAEM_COUNT_OFF
        na.saem_moe_set_counting(ctx, na.SAEM_COUNT_IDS)
        if with_cache:
            slots = [i.n_expert // 2 for i in layer_infos(ctx)]
            na.saem_moe_cache_init(ctx, slots)
            random_fill(ctx, random.Random(7), slots, p_map=0.8)
        prompt = r.tokenize(PROMPT)
        r.reset()
        r.decode(prompt)  # several ubatches of 8 tokens
        n_ub = (len(prompt) + 7) // 8
        for i in infos:
            seen = obs.ids[i.il]
            assert len(seen) == n_ub
            last = seen[-1]
            assert na.saem_moe_get_counts(ctx, i.il, na.COUNTS_LAST) == _hist(last, i.n_expert)
            assert na.saem_moe_get_last_ids(ctx, i.il) == last.tolist()
            total = np.concatenate(seen)
            assert na.saem_moe_get_counts(ctx, i.il, na.COUNTS_TOTAL) == _hist(total, i.n_expert)
        assert na.saem_moe_counted_tokens(ctx) == len(prompt)
        _check_all_layers(ctx, infos, [obs.ids[i.il][-1] for i in infos])

        # decode steps accumulate; reset clears
        na.saem_moe_reset_counts(ctx)
        assert na.saem_moe_counted_tokens(ctx) == 0
        obs.ids.clear()
        for t in prompt[:5]:
            r.decode([t])
        for i in infos:
            total = np.concatenate(obs.ids[i.il])
            assert total.shape == (5, i.n_expert_used)
            assert na.saem_moe_get_counts(ctx, i.il, na.COUNTS_TOTAL) == _hist(total, i.n_expert)
            assert na.saem_moe_get_counts(ctx, i.il, na.COUNTS_LAST) == _hist(obs.ids[i.il][-1], i.n_expert)
        assert na.saem_moe_counted_tokens(ctx) == 5
        _check_all_layers(ctx, infos, [obs.ids[i.il][-1] for i in infos])


def _check_all_layers(ctx, infos, last_per_layer: list[np.ndarray]) -> None:
    """saem_moe_get_last_routing = every layer's last ids in one int16 array, a layer with fewer
    rows (the last layer computes only the rows whose logits are wanted) aligned to the end."""
    n = max(len(x) for x in last_per_layer)
    want = np.full((n, len(infos), infos[0].n_expert_used), -1, np.int16)
    for l, ids in enumerate(last_per_layer):
        want[n - len(ids):, l] = ids
    for cap in (0, 1, want.size, want.size + 100):  # sizing call, too small, exact, roomy
        got = na.saem_moe_get_last_routing(ctx, cap)
        assert got.dtype == np.int16 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    # the engine's reader: the same rows at every read (a one-token read copies a kept view),
    # each read a new array of its own
    for cap in (1, want.size, want.size + 100):
        reader = na.LastRoutingReader(ctx, cap)
        reads = [reader.read() for _ in range(3)]
        reads[1][...] = 99  # must touch neither the other reads nor the reader's buffer
        for got in (reads[0], reads[2]):
            assert got.dtype == np.int16 and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def _sink_fields(header_addr: int) -> list[int]:
    return list((ctypes.c_int64 * na.SAEM_SINK_HEADER).from_address(header_addr))


@pytest.mark.parametrize("arch", NATIVE_ARCHS + ("deepseek2", "gpt-oss"))
def test_routing_sink_holds_what_get_last_routing_returns(arch):
    """After every compute (prompt ubatches, decode steps, a ubatch too large for the sink, the
    stock graph) and after reset_counts the sink's header and ids equal saem_moe_get_last_routing
    and its n_slot_uses at that moment; the serial counts the writes; a ubatch that does not fit
    leaves the ids untouched; the same or a smaller cap keeps the buffer, a larger one moves it;
    cap 0 turns it off; bad calls are refused with one line."""
    path = ensure_model(spec(arch, "q8_0", n_expert=16, n_expert_used=4, n_layer=3))
    with Runner(path, n_ubatch=8, n_batch=64) as r:
        ctx = r.ctx
        moe = [i for i in layer_infos(ctx) if i.n_expert > 0]
        per_token = len(moe) * moe[0].n_expert_used
        with pytest.raises(na.NativeArgumentError, match="SAEM_COUNT_IDS"):
            na.saem_moe_routing_sink(ctx, 4)  # counting off
        assert na.saem_moe_routing_sink(ctx, 0) == (0, 0, 0)  # turning it off needs no mode
        na.saem_moe_set_counting(ctx, na.SAEM_COUNT_IDS)
        with pytest.raises(na.NativeArgumentError, match="cap < 0"):
            na.saem_moe_routing_sink(ctx, -1)
        raw = na._fn("saem_moe_routing_sink")
        assert raw(na._ctx(ctx), 4, None, None) == na.SAEM_E_INVALID_ARG
        cap = 6 * per_token  # a 6-token ubatch fits, a full one of 8 does not
        n, header, ids = na.saem_moe_routing_sink(ctx, cap)
        assert n == cap and header and ids
        sink = np.ctypeslib.as_array((ctypes.c_int16 * n).from_address(ids))
        assert _sink_fields(header)[na.SAEM_SINK_NEED] == 0  # filled at once: nothing decoded yet

        def same_as_call(expect_written: bool) -> None:
            h = _sink_fields(header)
            uses = ctypes.c_int64(-1)
            want = na.saem_moe_get_last_routing(ctx, 10_000)
            na._call("saem_moe_get_last_routing", na._ctx(ctx), None, 0, None, None, None, ctypes.byref(uses))
            assert h[na.SAEM_SINK_NEED] == want.size
            assert (h[na.SAEM_SINK_N_TOKENS], h[na.SAEM_SINK_N_LAYERS], h[na.SAEM_SINK_N_USED]) == want.shape
            assert h[na.SAEM_SINK_N_SLOT_USES] == uses.value
            if expect_written:
                np.testing.assert_array_equal(sink[:want.size].reshape(want.shape), want)

        prompt = r.tokenize(PROMPT) * 3
        assert len(prompt) >= 40
        r.reset()
        serial = _sink_fields(header)[na.SAEM_SINK_SERIAL]
        r.decode(prompt[:6])  # one ubatch of 6
        assert _sink_fields(header)[na.SAEM_SINK_SERIAL] == serial + 1
        same_as_call(True)
        slots = [i.n_expert // 2 if i.n_expert else 0 for i in layer_infos(ctx)]
        na.saem_moe_cache_init(ctx, slots)
        rng = random.Random(3)
        for t in prompt[6:12]:
            random_fill(ctx, rng, slots, p_map=0.7)
            r.decode([t])
            same_as_call(True)
        before = sink.copy()
        serial = _sink_fields(header)[na.SAEM_SINK_SERIAL]
        r.decode(prompt[12:28])  # two ubatches of 8: each needs more than the sink holds
        assert _sink_fields(header)[na.SAEM_SINK_SERIAL] == serial + 2
        same_as_call(False)
        np.testing.assert_array_equal(sink, before)  # not written
        reader = na.LastRoutingReader(ctx, cap)
        np.testing.assert_array_equal(reader.view(), na.saem_moe_get_last_routing(ctx, 10_000))  # the call's path
        na.saem_moe_set_stock_min_batch(ctx, 4)
        r.decode(prompt[28:34])  # the stock graph
        same_as_call(True)
        na.saem_moe_reset_counts(ctx)
        same_as_call(True)
        assert _sink_fields(header)[na.SAEM_SINK_N_TOKENS] == 0

        # the buffer stays where it is for the same or a smaller cap, moves for a larger one
        assert na.saem_moe_routing_sink(ctx, cap) == (n, header, ids)
        assert na.saem_moe_routing_sink(ctx, 1) == (n, header, ids)
        n2, header2, _ = na.saem_moe_routing_sink(ctx, 4 * cap)
        assert n2 == 4 * cap and header2 == header
        assert na.saem_moe_routing_sink(ctx, 0) == (0, 0, 0)
        r.decode(prompt[34:35])  # nothing to write into
        n3, header3, ids3 = na.saem_moe_routing_sink(ctx, per_token)
        assert n3 == per_token
        sink3 = np.ctypeslib.as_array((ctypes.c_int16 * n3).from_address(ids3))
        np.testing.assert_array_equal(sink3.reshape(1, len(moe), -1), na.saem_moe_get_last_routing(ctx, 10_000))

        # the reader: a one-token view is the same object each time and follows the decodes; read
        # copies; one_token gives that view and the slot uses, from the first one-token read on
        reader = na.LastRoutingReader(ctx, per_token)
        r.decode(prompt[35:36])
        first, first_uses = reader.one_token()
        assert first_uses == reader.slot_uses
        v1 = reader.view()
        assert v1 is first
        r1 = reader.read()
        np.testing.assert_array_equal(v1, na.saem_moe_get_last_routing(ctx, 10_000))
        r.decode(prompt[36:37])
        v2 = reader.view()
        assert v2 is v1 and reader.n_tokens == 1
        np.testing.assert_array_equal(v2, na.saem_moe_get_last_routing(ctx, 10_000))
        one, uses = reader.one_token()
        assert one is v1 and uses == reader.slot_uses
        r1[...] = 99  # read's array is its own
        assert (reader.view() != 99).all()
        r.decode(prompt[37:39])  # two tokens: not a decode step's row
        assert reader.one_token() is None and reader.n_tokens == 2


@pytest.mark.parametrize("arch", NATIVE_ARCHS + ("deepseek2", "gpt-oss"))
def test_slot_uses_are_the_hits_under_the_maps_the_decode_ran_with(arch):
    """get_last_routing's n_slot_uses (what the engine counts hits with) = the (token, layer, k)
    uses whose expert the layer's map sent to a slot during that decode, as step_uses counts them
    on the maps read back; maps changed after the decode do not change it; 0 on the stock graph
    (a ubatch of stock_min_batch tokens or more) and with no cache."""
    path = ensure_model(spec(arch, "q8_0", n_expert=16, n_expert_used=4, n_layer=3))
    rng = random.Random(11)
    with Runner(path, n_ubatch=8, n_batch=64) as r:
        ctx = r.ctx
        moe = [i for i in layer_infos(ctx) if i.n_expert > 0]
        na.saem_moe_set_counting(ctx, na.SAEM_COUNT_IDS)
        reader = na.LastRoutingReader(ctx, 8 * len(moe) * moe[0].n_expert_used)
        prompt = r.tokenize(PROMPT) * 3
        assert len(prompt) >= 26
        r.reset()
        r.decode(prompt[:6])
        reader.read()
        assert reader.slot_uses == 0  # no cache
        slots = [i.n_expert // 2 if i.n_expert else 0 for i in layer_infos(ctx)]
        na.saem_moe_cache_init(ctx, slots)
        seen = []
        for t in prompt[6:14]:
            random_fill(ctx, rng, slots, p_map=rng.choice((0.3, 0.8, 1.0)))
            maps = np.array([na.saem_moe_get_slot_map(ctx, i.il) for i in moe], np.int32)
            r.decode([t])
            random_fill(ctx, rng, slots, p_map=0.5)  # after the decode: not what it ran with
            routing = reader.read()
            want, _ = step_uses(routing, maps)
            assert reader.slot_uses == want
            seen.append(want)
        assert len(set(seen)) > 2 and max(seen) > 0  # the maps made a difference
        r.decode(prompt[14:20])  # 6 tokens, under the cache graph
        maps = np.array([na.saem_moe_get_slot_map(ctx, i.il) for i in moe], np.int32)
        routing = reader.read()
        assert reader.slot_uses == sum(step_uses(routing[t:t + 1], maps)[0] for t in range(routing.shape[0]))
        na.saem_moe_set_stock_min_batch(ctx, 4)
        r.decode(prompt[20:26])  # 6 tokens >= 4: the stock graph, no slot served
        reader.read()
        assert reader.slot_uses == 0


def test_counting_does_not_change_logits_and_can_be_switched_off():
    path = ensure_model(spec("qwen2moe", "q4_0"))
    with Runner(path) as r:
        prompt = r.tokenize(PROMPT)
        toks0, logits0 = r.greedy(prompt, 4)
        na.saem_moe_set_counting(r.ctx, na.SAEM_COUNT_ON)
        toks1, logits1 = r.greedy(prompt, 4)
        assert toks0 == toks1 and all(np.array_equal(a, b) for a, b in zip(logits0, logits1))
        il = next(i.il for i in layer_infos(r.ctx) if i.n_expert > 0)
        total = na.saem_moe_get_counts(r.ctx, il, na.COUNTS_TOTAL)
        assert sum(total) == (len(prompt) + 4) * 2
        with pytest.raises(na.NativeArgumentError, match="SAEM_COUNT_IDS"):
            na.saem_moe_get_last_ids(r.ctx, il)  # ids are kept only in mode 2
        with pytest.raises(na.NativeArgumentError, match="SAEM_COUNT_IDS"):
            na.saem_moe_get_last_routing(r.ctx)
        na.saem_moe_set_counting(r.ctx, na.SAEM_COUNT_OFF)
        r.decode([prompt[0]])
        assert na.saem_moe_get_counts(r.ctx, il, na.COUNTS_TOTAL) == total  # no longer counting
