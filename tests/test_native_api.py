"""The native C API via saem_gguf.native_api: layer info, and every bad argument raises a
NativeError subclass (a SaemError) with a message instead of crashing the process."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from native_helpers import Runner, layer_infos, spec, stock_load_repacks
from saem_gguf import native_api as na
from saem_gguf.errors import SaemError
from saem_gguf.testmodels import ModelSpec, ensure_model


@pytest.fixture(scope="module")
def runner():
    with Runner(ensure_model(spec("qwen3moe", "q4_0", n_layer=2, n_expert=8, n_expert_used=2))) as r:
        yield r


def test_version_and_layer_info(runner):
    assert na.saem_native_abi_version() == na.ABI_VERSION
    assert na.saem_native_version().startswith("saem-native ")
    ctx = runner.ctx
    assert na.saem_moe_n_layers(ctx) == 2
    info = na.saem_moe_get_layer_info(ctx, 1)
    assert (info.il, info.n_expert, info.n_expert_used, info.n_slots, info.n_resident) == (1, 8, 2, 0, 0)
    assert info.n_mats == 3 and not info.fused_gate_up
    assert info.host_copyable and not info.host_pinned and info.device_is_host and info.device == "CPU"
    # q4_0: 18 bytes per 32 weights; up/gate [64 x 64], down [64 x 64]
    assert info.mat_nbytes == (64 * 64 // 32 * 18,) * 3
    assert info.expert_nbytes == sum(info.mat_nbytes)
    assert not na.saem_moe_cache_is_init(ctx)


def test_errors_before_init(runner):
    ctx = runner.ctx
    with pytest.raises(na.CacheNotInitialisedError, match="not initialised"):
        na.saem_moe_set_slot_map(ctx, 0, [-1] * 8)
    with pytest.raises(na.CacheNotInitialisedError):
        na.saem_moe_copy_expert(ctx, 0, 0, 0)
    with pytest.raises(na.CacheNotInitialisedError):
        na.saem_moe_copy_query(ctx)
    with pytest.raises(na.NativeArgumentError, match="layer 7 out of range"):
        na.saem_moe_get_layer_info(ctx, 7)
    with pytest.raises(na.NativeArgumentError, match="layer -1 out of range"):
        na.saem_moe_get_counts(ctx, -1)
    assert na.saem_moe_get_counts(ctx, 0) == [0] * 8  # counters read zero before anything counted


def test_bad_arguments_raise(runner):
    ctx = runner.ctx
    na.saem_moe_cache_init(ctx, [4, 2])
    try:
        assert na.saem_moe_cache_is_init(ctx)
        assert [i.n_slots for i in layer_infos(ctx)] == [4, 2]
        cases = [
            (lambda: na.saem_moe_cache_init(ctx, [4]), na.NativeArgumentError, "1 entries, the model has 2"),
            (lambda: na.saem_moe_cache_init(ctx, [4, -1]), na.NativeArgumentError, "negative"),
            (lambda: na.saem_moe_cache_init(ctx, [9, 0]), na.NativeArgumentError, "9 slots for 8 experts"),
            (lambda: na.saem_moe_copy_expert(ctx, 2, 0, 0), na.NativeArgumentError, "layer 2 out of range"),
            (lambda: na.saem_moe_copy_expert(ctx, 0, 8, 0), na.NativeArgumentError, "expert 8 out of range"),
            (lambda: na.saem_moe_copy_expert(ctx, 0, -1, 0), na.NativeArgumentError, "expert -1"),
            (lambda: na.saem_moe_copy_expert(ctx, 1, 0, 2), na.NativeArgumentError, "slot 2 out of range"),
            (lambda: na.saem_moe_copy_expert_async(ctx, 0, 0, -3), na.NativeArgumentError, "slot -3"),
            (lambda: na.saem_moe_set_slot_map(ctx, 0, [-1] * 7), na.NativeArgumentError, "7 entries, expected 8"),
            (lambda: na.saem_moe_set_slot_map(ctx, 0, [4] + [-1] * 7), na.NativeArgumentError, "out of range"),
            (lambda: na.saem_moe_set_slot_map(ctx, 0, [-2] + [-1] * 7), na.NativeArgumentError, "out of range"),
            (lambda: na.saem_moe_set_slot_map(ctx, 0, [0] + [-1] * 7), na.NativeArgumentError,
             "holds expert -1, not 0"),
            (lambda: na.saem_moe_set_counting(ctx, 3), na.NativeArgumentError, "counting mode 3"),
            (lambda: na.saem_moe_get_counts(ctx, 0, 2), na.NativeArgumentError, "which"),
            (lambda: na.saem_moe_set_stock_min_batch(ctx, 0), na.NativeArgumentError, ">= 1"),
            (lambda: na.saem_moe_n_layers(None), na.NativeArgumentError, "ctx"),
            (lambda: na.saem_moe_cache_init(ctx, ["x", 1]), na.NativeArgumentError, "n_slots"),
        ]
        for fn, exc, msg in cases:
            with pytest.raises(exc, match=msg) as ei:
                fn()
            assert isinstance(ei.value, SaemError) and ei.value.code < 0
        assert na.saem_last_error()  # the message of the last failing call

        # a slot may be mapped once, and only for the expert it holds
        na.saem_moe_copy_expert(ctx, 0, 3, 0, update_map=False)
        na.saem_moe_copy_expert(ctx, 0, 5, 1, update_map=False)
        with pytest.raises(na.NativeArgumentError, match="holds expert 3, not 5"):
            na.saem_moe_set_slot_map(ctx, 0, [-1, -1, -1, -1, -1, 0, -1, -1])
        na.saem_moe_copy_expert(ctx, 0, 3, 2, update_map=False)  # expert 3 now in slots 0 and 2
        with pytest.raises(na.NativeArgumentError, match="slot 0 mapped by experts 3 and"):
            na.saem_moe_set_slot_map(ctx, 0, [-1, -1, -1, 0, -1, 0, -1, -1])
        na.saem_moe_set_slot_map(ctx, 0, [-1, -1, -1, 2, -1, 1, -1, -1])
        assert na.saem_moe_get_slot_map(ctx, 0) == [-1, -1, -1, 2, -1, 1, -1, -1]
        assert na.saem_moe_get_slot_owner(ctx, 0) == [3, 5, 3, -1]
        # overwriting a mapped slot sends its expert back to the host
        na.saem_moe_copy_expert(ctx, 0, 6, 1, update_map=False)
        assert na.saem_moe_get_slot_map(ctx, 0) == [-1, -1, -1, 2, -1, -1, -1, -1]
        na.saem_moe_copy_expert(ctx, 0, 6, 3)  # update_map: 6 -> 3
        assert na.saem_moe_get_slot_map(ctx, 0)[6] == 3
        assert na.saem_moe_get_layer_info(ctx, 0).n_resident == 2
        assert na.saem_moe_copy_query(ctx)
        na.saem_moe_copy_sync(ctx)
        # a map from NumPy: an int32 row is passed as its own memory (what the engine does), any
        # other array through a list; all set the same map, and a bad entry is refused the same
        want = [-1, -1, -1, 2, -1, -1, 3, -1]
        row = np.array(want, np.int32)
        strided = np.stack([row, row], axis=1)[:, 0]  # int32, not contiguous
        assert not strided.flags.c_contiguous
        # the row's own memory is what the call reads (no list, no copy)
        arg = na._i32_array(row, "expert_to_slot")._as_parameter_
        assert ctypes.cast(arg, ctypes.c_void_p).value == row.ctypes.data
        for m in (row, row.astype(np.int64), strided):
            na.saem_moe_set_slot_map(ctx, 0, np.full(8, -1, np.int32))
            assert na.saem_moe_get_slot_map(ctx, 0) == [-1] * 8
            na.saem_moe_set_slot_map(ctx, 0, m)
            assert na.saem_moe_get_slot_map(ctx, 0) == want
        with pytest.raises(na.NativeArgumentError, match="7 entries, expected 8"):
            na.saem_moe_set_slot_map(ctx, 0, np.full(7, -1, np.int32))
        with pytest.raises(na.NativeArgumentError, match="out of range"):
            na.saem_moe_set_slot_map(ctx, 0, np.array([4] + [-1] * 7, np.int32))
        assert na.saem_moe_get_slot_map(ctx, 0) == want  # a refused map changes nothing
        # the context still decodes after all the failures
        runner.reset()
        runner.decode(runner.tokenize("hello world"))
    finally:
        na.saem_moe_cache_init(ctx, [0, 0])  # all zero frees the cache
    assert not na.saem_moe_cache_is_init(ctx)
    with pytest.raises(na.CacheNotInitialisedError):
        na.saem_moe_get_slot_map(ctx, 0)


def _books(ctx) -> tuple[list, list]:
    """Every MoE layer's slot map and slot owners."""
    infos = [i for i in layer_infos(ctx) if i.n_expert > 0]
    return ([na.saem_moe_get_slot_map(ctx, i.il) for i in infos],
            [na.saem_moe_get_slot_owner(ctx, i.il) for i in infos])


def test_batched_copies_and_maps_equal_one_call_each(runner):
    """saem_moe_copy_experts_async and saem_moe_set_slot_maps (the engine's calls: one each per
    decision) leave the books one call per copy and per map leaves, move the weights (greedy
    logits with every slot mapped equal the run without a cache, bit for bit on the CPU), and
    check every entry before changing anything."""
    ctx = runner.ctx
    prompt = runner.tokenize("the quick brown fox")
    runner.reset()
    want = runner.decode(prompt)
    # in order: slot 0 of layer 0 is written twice (the second copy wins and unmaps nothing new)
    copies = np.array([[0, 3, 0], [1, 6, 1], [0, 5, 1], [0, 7, 0], [1, 2, 0], [0, 1, 3]], np.int32)
    one_by_one = None
    for batched in (False, True):
        na.saem_moe_cache_init(ctx, [0, 0])
        na.saem_moe_cache_init(ctx, [4, 2])
        try:
            if batched:
                na.saem_moe_copy_experts_async(ctx, copies)
            else:
                for il, e, s in copies.tolist():
                    na.saem_moe_copy_expert_async(ctx, il, e, s, False)
            books = _books(ctx)
            assert books[1] == [[7, 5, -1, 1], [2, 6]]
            assert books[0] == [[-1] * 8, [-1] * 8]
            maps = np.full((2, 8), -1, np.int32)
            for l, owners in enumerate(books[1]):
                for s, e in enumerate(owners):
                    if e >= 0:
                        maps[l, e] = s
            if batched:
                na.saem_moe_set_slot_maps(ctx, np.array([1, 0], np.int32), maps[[1, 0]])
            else:
                for l in (1, 0):
                    na.saem_moe_set_slot_map(ctx, l, maps[l])
            books = _books(ctx)
            if one_by_one is None:
                one_by_one = books
            assert books == one_by_one
            assert [na.saem_moe_get_layer_info(ctx, il).n_resident for il in (0, 1)] == [3, 2]
            runner.reset()
            np.testing.assert_array_equal(runner.decode(prompt), want)

            # a bad entry anywhere in a batch: refused before anything changed
            for bad, exc, msg in (
                    ([[0, 2, 2], [1, 8, 0]], na.NativeArgumentError, "expert 8 out of range"),
                    ([[0, 2, 2], [1, 0, 2]], na.NativeArgumentError, "slot 2 out of range"),
                    ([[0, 2, 2], [5, 0, 0]], na.NativeArgumentError, "layer 5 out of range"),
                    ([[0, 2]], na.NativeArgumentError, "shape"),
                    ([["x", 0, 0]], na.NativeArgumentError, "copies")):
                with pytest.raises(exc, match=msg):
                    na.saem_moe_copy_experts_async(ctx, bad)
                assert _books(ctx) == one_by_one
            bad_map = maps[1].copy()
            bad_map[0] = 1  # slot 1 of layer 1 holds expert 6, not 0
            empty = np.full(8, -1, np.int32)
            for layers, rows, msg in (
                    ([0, 1], [empty, bad_map], "holds expert 6, not 0"),
                    ([0, 0], [empty, empty], "layer 0 given twice"),
                    ([0, 1], [empty[:7], empty[:7]], "7 entries per layer, layer 0 has 8"),
                    ([0], [empty, empty], "2 rows for 1 layers"),
                    ([2], [empty], "layer 2 out of range")):
                with pytest.raises(na.NativeArgumentError, match=msg):
                    na.saem_moe_set_slot_maps(ctx, layers, np.array(rows))
                assert _books(ctx) == one_by_one  # the first, good map was not set either
            na.saem_moe_copy_experts_async(ctx, np.zeros((0, 3), np.int32))  # nothing to do
            na.saem_moe_set_slot_maps(ctx, [], np.zeros((0, 8), np.int32))
            assert _books(ctx) == one_by_one
        finally:
            na.saem_moe_cache_init(ctx, [0, 0])


def test_dense_model_is_not_moe():
    with Runner(ensure_model(ModelSpec(arch="llama", dense=True, expert_type="q8_0"))) as r:
        assert all(i.n_expert == 0 for i in layer_infos(r.ctx))
        with pytest.raises(na.NotMoEError, match="no expert layers"):
            na.saem_moe_cache_init(r.ctx, [0] * na.saem_moe_n_layers(r.ctx))
        with pytest.raises(na.NotMoEError):
            na.saem_moe_set_counting(r.ctx, na.SAEM_COUNT_ON)
        with pytest.raises(na.NotMoEError):
            na.saem_moe_get_counts(r.ctx, 0)
        with pytest.raises(na.NotMoEError):
            na.saem_moe_copy_expert(r.ctx, 0, 0, 0)


def test_dense_lead_layer_takes_no_slots():
    with Runner(ensure_model(spec("deepseek2", "q8_0"))) as r:
        infos = layer_infos(r.ctx)
        assert [i.n_expert for i in infos] == [0, 8, 8]
        assert not infos[0].host_copyable and infos[1].host_copyable
        with pytest.raises(na.NotMoEError, match="layer 0 has no experts"):
            na.saem_moe_cache_init(r.ctx, [1, 1, 1])
        na.saem_moe_cache_init(r.ctx, [0, 1, 1])
        with pytest.raises(na.NotMoEError):
            na.saem_moe_set_slot_map(r.ctx, 0, [])


def test_the_expert_override_keeps_experts_plain_where_the_rest_is_repacked():
    """With extra buffer types on (llama.cpp's default), an override to saem_expert_host_buft()
    keeps the Q4_0 experts as the file has them, mapped from it (so a GPU's cache can copy them,
    and the RAM tier find them), where an override to the CPU buffer type itself lets llama.cpp
    repack them (test_repacked_experts_go_to_repacked_cpu_slots shows that without an override)."""
    path = ensure_model(spec("qwen3moe", "q4_0", n_embd=128, n_ff_exp=128))
    if not stock_load_repacks(path):
        pytest.skip("this CPU has no repacked Q4_0 layout (no extra buffer type used)")
    with Runner(path, repack=True, keep_on_host=True) as r:
        infos = layer_infos(r.ctx)
        assert all(i.host_copyable and not any(i.repacked) for i in infos)
        na.saem_moe_cache_init(r.ctx, [2] * len(infos))
        assert na.saem_ram_experts_mapped(r.ctx)[0]


def test_repacked_experts_go_to_repacked_cpu_slots():
    """Q4_0 experts repacked by the CPU backend (use_extra_bufts, no override: as stock loads them)
    are copyable into slots on the CPU, which are repacked alike (test_native_exact checks the
    logits bit for bit); they are not the file's mapped pages (the RAM tier needs the override)."""
    path = ensure_model(spec("qwen3moe", "q4_0", n_embd=128, n_ff_exp=128))
    if not stock_load_repacks(path):
        pytest.skip("this CPU has no repacked Q4_0 layout (no extra buffer type used)")
    with Runner(path, repack=True, keep_on_host=False) as r:
        infos = layer_infos(r.ctx)
        assert all(i.host_copyable and i.device_is_host and all(i.repacked) for i in infos)
        na.saem_moe_cache_init(r.ctx, [2] * len(infos))
        na.saem_moe_copy_expert(r.ctx, 0, 3, 1)
        assert na.saem_moe_get_slot_map(r.ctx, 0)[3] == 1
        assert not na.saem_ram_experts_mapped(r.ctx)[0]
        na.saem_moe_set_counting(r.ctx, na.SAEM_COUNT_ON)
        r.decode(r.tokenize("hello"))
        assert sum(na.saem_moe_get_counts(r.ctx, 0)) > 0


def test_unsupported_architecture_is_refused(monkeypatch):
    """An architecture outside the verified list gets a clear error from cache init. The generator
    only builds supported architectures, so the refusal is exercised through the allow-list env."""
    monkeypatch.setenv("SAEM_MOE_ARCH_DENY", "qwen3moe")
    with Runner(ensure_model(spec("qwen3moe", "q8_0"))) as r:
        with pytest.raises(na.UnsupportedModelError, match="architecture 'qwen3moe' is not supported"):
            na.saem_moe_cache_init(r.ctx, [1, 1])
        assert not na.saem_moe_cache_is_init(r.ctx)
