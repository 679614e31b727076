"""Bit-exactness of the expert cache on the CPU: for every generated test architecture and expert
quant type, logits with no cache equal, bit for bit, logits with (a) an all-host map, (b) random maps
with experts copied into random slots, (c) every expert resident, (d) maps (and layer modes) changed
between decode steps - the greedy continuation equals the no-cache one. Also with the GPU scheme
(zero slot, device copies of biases) forced on the CPU. And with the experts as llama.cpp loads them
by default on an AVX2 CPU: Q4_0 / Q4_K repacked (CPU_REPACK), in repacked CPU slots.

Ubatches of >= stock_min_batch tokens use the stock graph; the tests raise it so that the prompt
(one multi-token ubatch) also goes through the cache, then check the default keeps prompts stock."""

from __future__ import annotations

import random

import numpy as np
import pytest

from native_helpers import (EXTRA_ARCHS, NATIVE_ARCHS, PROMPT, QUANTS, Runner, TopkObserver,
                            all_resident, layer_infos, random_fill, spec)
from saem_gguf import native_api as na
from saem_gguf.testmodels import ARCHS, ensure_model

N_STEPS = 6


def _cases():
    out = [(a, q) for a in NATIVE_ARCHS for q in QUANTS] + [("qwen3moe", "q4_k")]
    out += [(a, "q8_0") for a in EXTRA_ARCHS]
    return out


# llama.cpp repacks these expert types on AVX2 CPUs (use_extra_bufts, its default); "A/B": the down
# experts in B (Q8_0, not repacked on x86), as Q4_K_M files hold some in Q6_K: repacked in part
REPACKED = [("qwen3moe", "q4_0"), ("qwen3moe", "q4_k"), ("llama", "q4_0"), ("qwen2moe", "q4_0"),
            ("qwen3moe", "q4_k/q8_0")]


def _runner(arch: str, quant: str, repack: bool) -> Runner:
    """The model on the CPU, its experts plain (an override to saem_expert_host_buft) or, with
    ``repack``, as stock llama.cpp loads it (extra buffer types on, no override)."""
    return Runner(_model(arch, quant), repack=repack, keep_on_host=not repack)


def _model(arch: str, quant: str):
    if arch.partition("+")[0] not in ARCHS:
        pytest.skip(f"no test-model generator for {arch}")
    quant, _, down = quant.partition("/")
    return ensure_model(spec(arch, quant, down_expert_type=down))


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def _maxdiff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference():
    """(arch, quant) -> (prompt tokens, greedy tokens, logits per step) with no cache at all."""
    memo = {}

    def get(arch, quant, repack=False):
        if (arch, quant, repack) not in memo:
            with _runner(arch, quant, repack) as r:
                toks = r.tokenize(PROMPT)
                memo[(arch, quant, repack)] = (toks, *r.greedy(toks, N_STEPS))
        return memo[(arch, quant, repack)]

    return get


@pytest.mark.parametrize("arch,quant", _cases())
def test_cache_maps_are_bit_exact(reference, arch, quant):
    _check_maps(reference, arch, quant)


# The GPU scheme, run on the CPU: non-resident rows of the device branch hit the all-zero slot
# (no skip flag) and per-expert biases are read from whole device copies (SAEM_MOE_ZERO_SLOT=2).
@pytest.mark.parametrize("arch,quant", [("qwen3moe", "q4_0"), ("qwen2moe", "f16"), ("llama", "q8_0"),
                                        ("qwen3moe", "q4_k"), ("gpt-oss", "q8_0"), ("deepseek2+fused", "q8_0")])
def test_zero_slot_scheme_is_bit_exact(reference, monkeypatch, arch, quant):
    monkeypatch.setenv("SAEM_MOE_ZERO_SLOT", "2")
    _check_maps(reference, arch, quant)


@pytest.mark.parametrize("arch,quant", REPACKED)
def test_repacked_cache_maps_are_bit_exact(reference, arch, quant):
    _check_maps(reference, arch, quant, repack=True)


def _check_repacked(infos, repack: bool) -> None:
    """The experts are in the layout the test means (skips where this CPU has no repacked one)."""
    moe = [i for i in infos if i.n_expert > 0]
    if not repack:
        assert not any(any(i.repacked) for i in moe)
    elif not any(any(i.repacked) for i in moe):
        pytest.skip("this CPU has no repacked layout for these experts (llama.cpp repacks them on AVX2)")
    elif len({t for i in moe for t in i.types}) > 1:  # "A/B": A repacked, B (the down experts) not
        assert all(i.repacked[:-1] == (True,) * (i.n_mats - 1) and not i.repacked[-1] for i in moe)


def _check_maps(reference, arch, quant, repack=False):
    prompt, ref_toks, ref_logits = reference(arch, quant, repack)
    with _runner(arch, quant, repack) as r:
        ctx = r.ctx
        infos = layer_infos(ctx)
        moe = [i for i in infos if i.n_expert > 0]
        assert moe and all(i.host_copyable for i in moe)
        _check_repacked(infos, repack)
        na.saem_moe_set_stock_min_batch(ctx, 10_000)  # the prompt ubatch goes through the cache too

        # (a) cache with slots, all-host map (one slot in the first MoE layer: a 1-slot weight
        # tensor is 2-D, which ggml's repacked kernels refuse unless the cache pads it)
        slots = [i.n_expert // 2 for i in infos]
        slots[moe[0].il] = 1
        na.saem_moe_cache_init(ctx, slots)
        toks, logits = r.greedy(prompt, N_STEPS)
        assert toks == ref_toks and _same(logits, ref_logits), "all-host map"

        # (b) random maps, experts copied into random slots (several draws)
        for seed in range(3):
            random_fill(ctx, random.Random(seed), slots, p_map=0.7)
            assert any(na.saem_moe_get_layer_info(ctx, i.il).n_resident > 0 for i in moe)
            toks, logits = r.greedy(prompt, N_STEPS)
            assert toks == ref_toks and _same(logits, ref_logits), \
                f"random map seed {seed}: max |diff| {_maxdiff(logits, ref_logits)}"

        # (c) every expert resident
        na.saem_moe_cache_init(ctx, [i.n_expert for i in infos])
        all_resident(ctx)
        assert all(na.saem_moe_get_layer_info(ctx, i.il).n_resident == i.n_expert for i in moe)
        toks, logits = r.greedy(prompt, N_STEPS)
        assert toks == ref_toks and _same(logits, ref_logits), f"all resident: {_maxdiff(logits, ref_logits)}"


@pytest.mark.parametrize("arch,quant,repack", [(a, q, False) for a, q in _cases()] +
                         [(a, q, True) for a, q in REPACKED])
def test_maps_changed_between_steps(reference, arch, quant, repack):
    """(d) every decode step sees a different map (random, all-host, all-resident, async copies)."""
    prompt, ref_toks, ref_logits = reference(arch, quant, repack)
    with _runner(arch, quant, repack) as r:
        ctx = r.ctx
        infos = layer_infos(ctx)
        _check_repacked(infos, repack)
        n_slots = [max(i.n_expert - 2, 0) for i in infos]
        na.saem_moe_cache_init(ctx, n_slots)
        rng = random.Random(1234)

        def change(step: int) -> None:
            kind = step % 4
            for i in infos:
                if i.n_expert == 0:
                    continue
                n_s = n_slots[i.il]
                if kind == 0:  # random copies (async API; synchronous on the CPU) + random map
                    for s in range(n_s):
                        na.saem_moe_copy_expert_async(ctx, i.il, rng.randrange(i.n_expert), s, update_map=False)
                    na.saem_moe_copy_sync(ctx)
                    owner = na.saem_moe_get_slot_owner(ctx, i.il)
                    m = [-1] * i.n_expert
                    for s, e in enumerate(owner):
                        if e >= 0 and m[e] == -1 and rng.random() < 0.8:
                            m[e] = s
                    na.saem_moe_set_slot_map(ctx, i.il, m)
                elif kind == 1:  # all host (stock graph for this layer)
                    na.saem_moe_set_slot_map(ctx, i.il, [-1] * i.n_expert)
                elif kind == 2:  # copy-and-map: evicts whatever was mapped in the slot
                    for _ in range(3):
                        na.saem_moe_copy_expert(ctx, i.il, rng.randrange(i.n_expert), rng.randrange(n_s))
                else:  # keep the map, overwrite a slot without mapping: its expert goes back to host
                    na.saem_moe_copy_expert(ctx, i.il, rng.randrange(i.n_expert), rng.randrange(n_s),
                                            update_map=False)
            assert na.saem_moe_copy_query(ctx)

        toks, logits = r.greedy(prompt, N_STEPS, before_step=change)
        assert toks == ref_toks
        assert _same(logits, ref_logits), f"max |diff| {_maxdiff(logits, ref_logits)}"


def test_branches_are_really_built():
    """With a mixed map the graph holds the device/host branches (seen by the eval callback); with
    the default stock_min_batch a prompt ubatch of >= 32 tokens uses the stock graph."""
    path = ensure_model(spec("qwen3moe", "q8_0"))
    obs_names: list[str] = []

    class Names(TopkObserver):
        def __call__(self, t, ask, user):
            from native_helpers import _ggml
            name = _ggml("ggml_get_name")(t).decode()
            if ask:
                obs_names.append(name)
            return False if ask else True

    with Runner(path, observer=Names()) as r:
        ctx = r.ctx
        infos = layer_infos(ctx)
        na.saem_moe_cache_init(ctx, [2] * len(infos))
        for i in infos:
            na.saem_moe_copy_expert(ctx, i.il, 0, 0)
        assert na.saem_moe_get_stock_min_batch(ctx) == 32
        toks = r.tokenize(PROMPT)
        r.reset()
        r.decode(toks)  # < 32 tokens: cache graph
        assert "ffn_moe_down_merged-0" in obs_names and "saem_ids_host-1" in obs_names
        obs_names.clear()
        r.reset()
        r.decode((toks * 4)[:40])  # 40 tokens >= 32: stock graph
        assert obs_names and not any(n.startswith("saem_") or "merged" in n for n in obs_names)
        obs_names.clear()
        r.decode(toks[:1])  # back to one token: cache graph again
        assert "ffn_moe_down_merged-1" in obs_names
