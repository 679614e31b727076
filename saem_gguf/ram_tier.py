"""The RAM tier: which experts of a memory-mapped GGUF stay in RAM, chosen by a placement policy.

llama.cpp maps the model file; its expert tensors are views of the mapping, so the kernel's page
cache decides which experts are in RAM, and a model larger than RAM pages them in 4 KiB faults in
the middle of a layer while the kernel evicts whatever it likes. The RAM tier decides instead:

* the non-expert weights are locked in RAM (``mlock``), so attention never pages;
* a policy object of the same kind as the VRAM cache's (``make_policy`` + ``CacheState``, one
  instance for this tier) keeps ``slots`` experts per MoE layer resident, ``slots`` being what the
  ``--ram-budget`` holds; it sees the same routing and stage events as the VRAM tier's policy;
* a newly resident expert is read ahead of use in large requests (``madvise(MADV_WILLNEED)`` or
  the native readahead thread); an evicted one, and one a step used without making it resident,
  is released (``MADV_PAGEOUT``, falling back to ``MADV_COLD`` / ``MADV_DONTNEED``, see
  ``native_api.saem_ram_release``);
* inside the graph, right after each MoE layer's router, the experts the token routes to are
  read ahead with one ``MADV_WILLNEED`` each (``saem_ram_set_route_prefetch``), so a miss costs
  one read of exactly that expert instead of page faults that each read llama.cpp's whole
  readahead window around them (8 MiB x 2 here: ``read_ahead_kb`` and ``POSIX_FADV_SEQUENTIAL``).

Nothing here changes a byte the model computes with: advice on read-only file pages changes only
when they are read from disk. With a GPU the VRAM tier sits on top, unchanged (its copies read
the host experts wherever the RAM tier left them). docs/RAM_TIER.md has the design and figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from saem_gguf import native_api as na
from saem_gguf.budget import AUTO, format_size, parse_size
from saem_gguf.errors import SaemError
from saem_gguf.gguf_info import ModelInfo, compute_buffer_bytes, kv_cache_bytes
from saem_gguf.placement import ENGINE_VARIANT
from saem_gguf.policies import make_policy
from saem_gguf.policies.base import PolicyContext
from saem_gguf.policies.state import (
    CacheState, RoutingBlock, StepEvents, step_uses, used_experts,
)
from saem_gguf.resources import available_memory

PREFETCH_METHODS = {"madvise": na.SAEM_RAM_PREFETCH_MADVISE, "thread": na.SAEM_RAM_PREFETCH_THREAD}
RELEASE_NAMES = {na.SAEM_RAM_RELEASE_PAGEOUT: "MADV_PAGEOUT", na.SAEM_RAM_RELEASE_COLD: "MADV_COLD",
                 na.SAEM_RAM_RELEASE_DONTNEED: "MADV_DONTNEED"}
# Policies whose placement is fixed all-or-nothing per layer have nothing to choose in RAM: the
# tier then runs the project's own policy (--ram-policy names another).
FIXED_POLICIES = ("cpu-moe", "n-cpu-moe", "gpu-all")
DEFAULT_RAM_POLICY = "saem"
# --ram-budget auto keeps this much of the available memory free: the process itself (Python,
# NumPy, Numba), llama.cpp's compute buffers and what other programs allocate meanwhile
AUTO_RAM_MARGIN_BYTES = 512 << 20
AUTO_RAM_MARGIN_FRACTION = 0.05


def parse_ram_budget(text: str) -> int | str:
    """'auto' or a size ('3G', '2.5GiB', '800M')."""
    if str(text).strip().lower() == AUTO:
        return AUTO
    n = parse_size(text)
    if n <= 0:
        raise SaemError(f"--ram-budget {text} must be above zero (or auto)")
    return n


def ram_policy_for(vram_policy: str, ram_policy: str | None) -> str:
    """The RAM tier's policy: ``--ram-policy`` if given, else the VRAM tier's unless that one is
    fixed (cpu-moe, n-cpu-moe, gpu-all), then saem."""
    if ram_policy is not None:
        if ram_policy in FIXED_POLICIES or ram_policy == "oracle":
            raise SaemError(f"--ram-policy {ram_policy} places nothing (or needs the future): choose a "
                            "caching or stage policy, e.g. saem, lru-cpu, static-hot")
        return ram_policy
    return DEFAULT_RAM_POLICY if vram_policy in FIXED_POLICIES else vram_policy


@dataclass(frozen=True)
class RamBudget:
    """How ``--ram-budget`` turned into slots: ``slots`` experts per MoE layer of ``n_expert``."""

    budget_bytes: int
    slots: int
    n_expert: int
    expert_bytes_all_layers: int  # one expert of every MoE layer
    note: str = ""

    @property
    def fraction(self) -> float:
        return self.slots / self.n_expert if self.n_expert else 0.0

    @property
    def resident_bytes(self) -> int:
        return self.slots * self.expert_bytes_all_layers


def plan_ram_budget(info: ModelInfo, budget: int | str, n_ctx: int,
                    available: Callable[[], int] | None = None) -> RamBudget:
    """Slots per layer that ``budget`` holds; ``auto``: the available memory (psutil, and the
    memory cgroup's room if it has a limit) minus the non-expert weights, the KV cache, the
    compute buffers and a margin."""
    if not info.is_moe:
        raise SaemError(f"{info.architecture} is a dense model: the RAM tier has no experts to place")
    per = info.bytes_per_expert_all_layers
    note = ""
    if budget == AUTO:
        avail = (available or available_memory)()
        if avail is None:
            raise SaemError("--ram-budget auto: this system does not say how much memory is available: "
                            "give --ram-budget a size")
        fixed = info.non_expert_bytes + kv_cache_bytes(info, n_ctx) + compute_buffer_bytes(info)
        margin = AUTO_RAM_MARGIN_BYTES + int(AUTO_RAM_MARGIN_FRACTION * avail)
        budget_bytes = avail - fixed - margin
        note = (f"auto: {format_size(avail)} available - {format_size(fixed)} non-expert weights, KV "
                f"cache and compute buffers - {format_size(margin)} margin")
        if budget_bytes < per:
            raise SaemError(f"--ram-budget auto: {format_size(avail)} available leaves no room for one "
                            f"expert per layer ({format_size(per)}) after the non-expert weights, KV cache "
                            f"and a {format_size(margin)} margin; give a size, or free memory")
    else:
        budget_bytes = int(budget)
        if budget_bytes < per:
            raise SaemError(f"--ram-budget {format_size(budget_bytes)} holds no expert: one expert of "
                            f"every MoE layer takes {format_size(per)}")
    slots = min(info.n_expert, budget_bytes // per)
    return RamBudget(budget_bytes, int(slots), info.n_expert, per, note)


@dataclass
class RamTierStats:
    accesses: int = 0  # (token, layer, k) expert uses while decoding
    hits: int = 0  # of those, the expert was resident in the tier
    prefetched: int = 0  # experts read ahead (newly resident)
    released: int = 0  # experts released (evicted, or used without staying)
    bytes_prefetched: int = 0
    route_prefetched: int = 0  # routed experts the graph's read-ahead advised (native count)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def to_dict(self) -> dict:
        return {"ram_accesses": self.accesses, "ram_hits": self.hits, "ram_hit_rate": round(self.hit_rate, 6),
                "ram_prefetched": self.prefetched, "ram_released": self.released,
                "ram_bytes_prefetched": self.bytes_prefetched, "ram_route_prefetched": self.route_prefetched}


class RamTier:
    """One policy over the experts of one llama context's mapping (the second tier below VRAM).

    Driven by ``Placement`` with what its own policy sees: ``begin_group`` after a prefill
    ubatch, ``on_step`` after each decode step (the step's routing rows and stage events)."""

    def __init__(self, ctx, moe_layers: list[int], policy_name: str, budget: RamBudget, cost,
                 prefetch: str = "madvise", calib_counts: np.ndarray | None = None,
                 cue_counts: dict[str, np.ndarray] | None = None) -> None:
        if prefetch not in PREFETCH_METHODS:
            raise SaemError(f"RAM prefetch method must be one of {', '.join(PREFETCH_METHODS)}, got {prefetch!r}")
        self.ctx = ctx
        self.moe_layers = list(moe_layers)
        self.budget = budget
        self.prefetch_method = PREFETCH_METHODS[prefetch]
        L, E = len(self.moe_layers), budget.n_expert
        self.expert_nbytes = [na.saem_moe_get_layer_info(ctx, il).expert_nbytes for il in self.moe_layers]
        self.policy_name = policy_name
        self.policy = make_policy(ENGINE_VARIANT.get(policy_name, policy_name))
        top_k = na.saem_moe_get_layer_info(ctx, self.moe_layers[0]).n_expert_used
        pctx = PolicyContext(n_layer=L, n_expert=E, top_k=top_k, n_slots=np.full(L, budget.slots, np.int32),
                             cost=cost, calib_counts=calib_counts, cue_counts=cue_counts)
        self.state: CacheState = self.policy.start(pctx)  # the policy's own books, updated in place
        self.reset_stats()
        self.release_advice = na.SAEM_RAM_RELEASE_AUTO  # becomes the advice the kernel accepted
        # experts used in passing: MADV_COLD, else (a kernel without it) what evictions get
        self.passing_advice = na.SAEM_RAM_RELEASE_COLD
        self._resident = np.zeros((L, E), bool)  # what the tier has made resident natively
        self._realise(self.state.slot_of >= 0, used=None, count=False, release_all_others=True)

    def reset_stats(self) -> None:
        """Counts start again from zero (a new placement over the same tier)."""
        self.stats = RamTierStats()
        self._route_base = na.saem_ram_route_prefetched(self.ctx)

    @property
    def release_name(self) -> str:
        return RELEASE_NAMES.get(self.release_advice, "none yet")

    def begin_group(self, block: RoutingBlock) -> None:
        """A prefill ubatch's counts: the policy may seed its placement from them."""
        self.policy.begin_group(block)
        self._realise(self.state.slot_of >= 0, used=None)

    def on_step(self, routing: np.ndarray, events: StepEvents) -> None:
        """After a decode step (``routing`` int16 [B, L, K], one row per sequence; ``events`` the
        stage events the VRAM policy observed with it): count the step's hits against the resident
        set it ran with, let the tier's policy observe it, then prefetch what became resident and
        release what left or was used only in passing."""
        hits, uses = step_uses(routing, self.state.slot_of)
        self.stats.hits += hits
        self.stats.accesses += uses
        self.policy.observe(routing, events)
        self._realise(self.state.slot_of >= 0, used=used_experts(routing, self._resident.shape[1]))
        self.stats.route_prefetched = na.saem_ram_route_prefetched(self.ctx) - self._route_base

    def _realise(self, want: np.ndarray, used: np.ndarray | None, count: bool = True,
                 release_all_others: bool = False) -> None:
        """Make the mapping hold ``want`` (bool [L, E]): prefetch the newly wanted, release the no
        longer wanted, and mark cold the ``used`` ones that are not wanted (the step read them in).

        Evicted experts are released with the strongest advice the kernel takes (MADV_PAGEOUT): the
        policy chose to drop them. An expert used in passing only gets MADV_COLD: it goes to the
        inactive list, so reclaim takes it before any resident expert, but while the memory limit
        has room beyond the budget the kernel keeps it, and the next miss on it is not a disk read.
        Paging it out at once (as evictions) made a policy that runs misses without admitting them
        (saem's stage and static leaders) read the same experts from disk again and again."""
        drop = ~want if release_all_others else (self._resident & ~want)
        passing = used & ~want & ~drop if used is not None else np.zeros_like(want)
        load = want & ~self._resident
        for l in np.flatnonzero(drop.any(axis=1) | passing.any(axis=1) | load.any(axis=1)).tolist():
            il = self.moe_layers[l]
            gone = np.flatnonzero(drop[l]).tolist()
            cold = np.flatnonzero(passing[l]).tolist()
            new = np.flatnonzero(load[l]).tolist()
            if gone:
                self.release_advice = na.saem_ram_release(self.ctx, il, gone, self.release_advice)
            if cold:
                self._mark_cold(il, cold)
            if new:
                na.saem_ram_prefetch(self.ctx, il, new, self.prefetch_method)
            if count:
                self.stats.released += len(gone) + len(cold)
                self.stats.prefetched += len(new)
                self.stats.bytes_prefetched += len(new) * self.expert_nbytes[l]
        self._resident = want.copy()

    def _mark_cold(self, il: int, experts: list[int]) -> None:
        """MADV_COLD on ``experts`` of layer ``il``; a kernel without it (Linux < 5.4) gets
        MADV_DONTNEED (unmapped from this process, the clean pages stay cached) from then on."""
        try:
            self.passing_advice = na.saem_ram_release(self.ctx, il, experts, self.passing_advice)
        except na.OsCallError:
            if self.passing_advice != na.SAEM_RAM_RELEASE_COLD:
                raise
            self.passing_advice = na.saem_ram_release(self.ctx, il, experts, na.SAEM_RAM_RELEASE_DONTNEED)

    def resident_pages(self) -> tuple[int, int]:
        """(resident, total) pages of every expert of every MoE layer (mincore): what is in RAM."""
        res = tot = 0
        for il in self.moe_layers:
            for e in range(self.budget.n_expert):
                r, t = na.saem_ram_expert_residency(self.ctx, il, e)
                res, tot = res + r, tot + t
        return res, tot


def lock_non_expert(ctx, note: Callable[[str], None]) -> int:
    """mlock the non-expert weights; a refusal is a note (they may then page), not an error."""
    try:
        n = na.saem_ram_lock_non_expert(ctx)
    except na.OsCallError as e:
        note(f"RAM tier: the non-expert weights are not locked, so they may page: {e}")
        return 0
    note(f"RAM tier: {format_size(n)} of non-expert weights locked in RAM")
    return n


@dataclass(frozen=True)
class RamTierSettings:
    """The RAM tier's flags: ``--ram-budget`` (bytes or ``auto``), ``--ram-policy`` (None: see
    ``ram_policy_for``), ``--ram-prefetch``, ``--no-ram-route-prefetch``."""

    budget: int | str
    policy: str | None = None
    prefetch: str = "madvise"
    route_prefetch: bool = True  # read the routed experts ahead inside the graph (saem_ram_set_route_prefetch)


def attach_ram_tier(llm, placement, info: ModelInfo, budget: RamBudget | None, settings: RamTierSettings,
                    note: Callable[[str], None]) -> RamTier | None:
    """Start the tier with ``budget`` (``plan_ram_budget``'s, made before the model loaded) under
    ``placement`` (the engine's), or say once why it is off and return None: expert management off
    (a dense model, an unsupported architecture), or experts not in the model file's mapping
    (--no-mmap, a GPU build's pinned host buffer, NUMA pinning, repacking)."""
    if placement is None or budget is None:
        note("RAM tier is off: expert management is off for this model")
        return None
    mapped, why = na.saem_ram_experts_mapped(llm)
    if not mapped:
        note(f"RAM tier is off: the experts are not memory-mapped ({why.split(': ', 1)[-1]})")
        return None
    policy = ram_policy_for(placement.policy.name, settings.policy)
    lock_non_expert(llm, note)
    na.saem_ram_set_route_prefetch(llm, settings.route_prefetch)
    pctx = placement.policy.ctx
    # the tier's copies are disk reads, not the VRAM link's: copy-cost-aware policies (the adaptive
    # saem's leader switches, its layout) price them so
    tier = RamTier(llm, placement.moe_layers, policy, budget, pctx.cost.ram_tier(), settings.prefetch,
                   calib_counts=pctx.calib_counts, cue_counts=pctx.cue_counts)
    placement.tiers.append(tier)
    note(f"RAM tier: {budget.slots}/{budget.n_expert} experts per layer resident "
         f"({budget.fraction:.1%}, {format_size(budget.resident_bytes)} of {format_size(info.expert_bytes)} "
         f"expert bytes), policy {policy}, prefetch {settings.prefetch}"
         f"{' + routed experts in the graph' if settings.route_prefetch else ''}, release {tier.release_name}"
         + (f"; {budget.note}" if budget.note else ""))
    return tier
