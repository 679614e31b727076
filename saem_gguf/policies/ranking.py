"""Ranking: make each layer's residents its top-scoring experts (SAEM's placement at a stage
boundary, the calibrated placement at load, the adaptive policy's stage candidate).

The ranking runs at every stage boundary on [L, E] arrays (48 x 128 for Qwen3-30B-A3B), so
it is one Numba kernel that writes the copies and evictions straight into preallocated rows;
bench/bench_planner.py times it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from saem_gguf.policies.state import CacheState, ResidencyPlan


@njit(cache=True)
def rank_fill_kernel(scores, n_slots, slot_of, owner, copies, evicts):
    """Per layer: the target set is the n_slots[l] experts of highest score; ties at the cut go
    to experts already resident (no churn for equal evidence), then to lower ids. Experts with
    score <= 0 are never copied in (no evidence: leave the slot as it is). Evictions free the
    slots of residents that leave; entrants fill free slots in decreasing score order, layer by
    layer (layer 0 first: the next step needs it first). Returns (n_copies, n_evictions).

    scores float64 [L, E]; n_slots int32 [L]; slot_of int32 [L, E] / owner int32 [L, Smax]: the
    CacheState (read only); copies / evicts int32 [sum(n_slots), 3]: written with (layer,
    expert, slot) rows, the first n_copies / n_evictions of them valid."""
    L, E = scores.shape
    nc = 0
    ne = 0
    key = np.empty(E, np.float64)
    want = np.zeros(E, np.bool_)
    for l in range(L):
        S = n_slots[l]
        if S <= 0:
            continue
        # Residents get a sub-ulp-scale bonus via a two-key sort: sort by (-score, !resident, id).
        for e in range(E):
            key[e] = -scores[l, e]
        order = np.argsort(key, kind="mergesort")
        take = min(S, E)
        thr = scores[l, order[take - 1]]
        n_in = 0
        for e in range(E):
            want[e] = False
        for i in range(E):
            e = order[i]
            if scores[l, e] > thr:
                want[e] = True
                n_in += 1
        # fill the remaining places at the threshold: residents first, then by id
        for pass_res in (True, False):
            for e in range(E):
                if n_in >= take:
                    break
                if not want[e] and scores[l, e] == thr and (slot_of[l, e] >= 0) == pass_res:
                    if thr <= 0.0 and slot_of[l, e] < 0:
                        continue
                    want[e] = True
                    n_in += 1
        for e in range(E):
            if want[e] and scores[l, e] <= 0.0 and slot_of[l, e] < 0:
                want[e] = False
        # evictions: residents not wanted
        for s in range(S):
            e = owner[l, s]
            if e >= 0 and not want[e]:
                evicts[ne, 0] = l
                evicts[ne, 1] = e
                evicts[ne, 2] = s
                ne += 1
        # copies: wanted non-residents, best first, into slots freed above or free before
        free_ptr = 0
        for i in range(E):
            e = order[i]
            if not want[e] or slot_of[l, e] >= 0:
                continue
            while free_ptr < S:
                o = owner[l, free_ptr]
                if o < 0 or not want[o]:
                    break
                free_ptr += 1
            copies[nc, 0] = l
            copies[nc, 1] = e
            copies[nc, 2] = free_ptr
            nc += 1
            free_ptr += 1
    return nc, ne


def plan_from_scores(state: CacheState, scores: np.ndarray, reason: str = "") -> ResidencyPlan:
    """The plan that makes each layer's residents its top-scoring experts (see rank_fill_kernel)."""
    scores = np.ascontiguousarray(scores, np.float64)
    L, E = state.slot_of.shape
    if scores.shape != (L, E):
        raise ValueError(f"scores shape {scores.shape} != {(L, E)}")
    cap = int(state.n_slots.sum())
    copies = np.empty((cap, 3), np.int32)
    evicts = np.empty((cap, 3), np.int32)
    nc, ne = rank_fill_kernel(scores, state.n_slots, state.slot_of, state.owner, copies, evicts)
    target = state.slot_of.copy()
    target[evicts[:ne, 0], evicts[:ne, 1]] = -1
    target[copies[:nc, 0], copies[:nc, 1]] = copies[:nc, 2]
    return ResidencyPlan(copies=copies[:nc].copy(), evictions=evicts[:ne].copy(), target=target, reason=reason)
