"""Soak: many generations on one engine, alternating policies, expert cache ratios and prompts;
then RSS growth, open file descriptors, threads and the native cache's state against bounds.

    python bench/soak.py                      # 2,000 generations of 32 tokens on a small test model
    python bench/soak.py --generations 200 --json soak.json

Every generation re-attaches placement (``Engine.set_placement``: the native expert cache is
freed and initialised again) with the next policy x ECR, then decodes a few greedy tokens of the
next prompt. After each generation the native cache must agree with the policy's view: per MoE
layer ``n_slots`` as planned, the slot map equal to the one the engine last set, every resident
expert owning exactly its slot. RSS is measured after a warm-up (allocator pools, JIT-compiled
planner kernels) and at the end; exit status 1 if a bound is exceeded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from saem_gguf import native_api as na  # noqa: E402
from saem_gguf.cli.arg_types import output_file  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.engine import Engine, EngineConfig  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
from saem_gguf.testmodels import STAGE_PLANT, ModelSpec, ensure_model  # noqa: E402

POLICIES = ("saem", "lru", "cpu-moe", "lfu", "saem-implicit", "temporal", "static-hot", "gpu-all")
ECRS = (0.125, 0.25, 0.5)
PROMPTS = ("First, compute 12 + 7. Wait, let me verify the sum.",
           "Alternatively, count the tens and the ones separately.",
           "Therefore the final answer is 19. Check it again.",
           "Split 47 into 40 and 7, then add 38.")
# bounds: a leak of one small allocation per generation (>= 8 KiB) over 2,000 generations
# exceeds the RSS bound; any descriptor or thread that is not given back exceeds theirs
RSS_GROWTH_BOUND = 16 << 20
FD_GROWTH_BOUND = 0
THREAD_GROWTH_BOUND = 0
WARMUP = 100


@dataclass
class SoakResult:
    generations: int
    tokens: int
    seconds: float
    rss_start: int  # after the warm-up
    rss_end: int
    rss_max: int
    fds_start: int
    fds_end: int
    threads_start: int
    threads_end: int
    cache_checks: int
    cache_errors: list[str]
    load_average: tuple[float, float, float]

    @property
    def rss_growth(self) -> int:
        return self.rss_end - self.rss_start

    def failures(self) -> list[str]:
        out = list(self.cache_errors[:10])
        if self.rss_growth > RSS_GROWTH_BOUND:
            out.append(f"RSS grew {self.rss_growth / 2**20:.1f} MiB (bound {RSS_GROWTH_BOUND >> 20} MiB)")
        if self.fds_end - self.fds_start > FD_GROWTH_BOUND:
            out.append(f"open fds grew from {self.fds_start} to {self.fds_end}")
        if self.threads_end - self.threads_start > THREAD_GROWTH_BOUND:
            out.append(f"threads grew from {self.threads_start} to {self.threads_end}")
        return out


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def check_native_cache(eng: Engine) -> list[str]:
    """Disagreements between the native cache and the engine's view of it."""
    p = eng.placement
    if p is None:
        return ["placement is off"]
    errors = []
    if not na.saem_moe_cache_is_init(eng.llm.ctx):
        # a policy with no slots (cpu-moe) leaves the cache uninitialised: then nothing is resident
        if int(p.state.n_slots.max(initial=0)) or (p._native >= 0).any():
            errors.append("native cache not initialised, but the policy placed experts")
        return errors
    for l, il in enumerate(p.moe_layers):
        info = na.saem_moe_get_layer_info(eng.llm.ctx, il)
        want_slots = int(p.state.n_slots[l])
        if info.n_slots != want_slots:
            errors.append(f"layer {il}: native n_slots {info.n_slots}, policy {want_slots}")
        slot_map = np.asarray(na.saem_moe_get_slot_map(eng.llm.ctx, il))
        if not np.array_equal(slot_map, p._native[l]):
            errors.append(f"layer {il}: native slot map differs from the one the engine set")
        owner = na.saem_moe_get_slot_owner(eng.llm.ctx, il)
        for e in np.nonzero(slot_map >= 0)[0]:
            if owner[slot_map[e]] != e:
                errors.append(f"layer {il}: slot {slot_map[e]} owned by {owner[slot_map[e]]}, mapped to {e}")
        if int((slot_map >= 0).sum()) > max(want_slots, 0) and want_slots < info.n_expert:
            errors.append(f"layer {il}: {int((slot_map >= 0).sum())} experts mapped into {want_slots} slots")
    return errors


def soak(model: Path, generations: int, n_predict: int, progress: bool) -> SoakResult:
    eng = Engine(EngineConfig(model=model, n_ctx=256, n_threads=2, progress=False))
    n_expert = eng.info.n_expert
    tokens = 0
    cache_errors: list[str] = []
    checks = 0
    rss_start = fds_start = threads_start = 0
    rss_max = 0
    t0 = time.time()
    try:
        for i in range(generations):
            if i == WARMUP or (i == 0 and generations <= WARMUP):
                rss_start, fds_start, threads_start = rss_bytes(), open_fds(), threads()
            policy = POLICIES[i % len(POLICIES)]
            slots = max(1, round(ECRS[(i // len(POLICIES)) % len(ECRS)] * n_expert))
            eng.set_placement(policy, slots)
            res = eng.generate(PROMPTS[i % len(PROMPTS)], n_predict)  # greedy
            tokens += len(res.tokens)
            errs = check_native_cache(eng)
            checks += 1
            cache_errors += [f"generation {i} ({policy}, {slots} slots): {e}" for e in errs]
            rss_max = max(rss_max, rss_bytes())
            if progress and (i + 1) % 100 == 0:
                print(f"{i + 1}/{generations}: RSS {rss_bytes() / 2**20:.1f} MiB, fds {open_fds()}, "
                      f"threads {threads()}, {time.time() - t0:.0f} s", file=sys.stderr)
    finally:
        eng.close()
    return SoakResult(generations, tokens, time.time() - t0, rss_start, rss_bytes(), rss_max,
                      fds_start, open_fds(), threads_start, threads(), checks, cache_errors,
                      os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generations", type=int, default=2000)
    ap.add_argument("-n", "--n-predict", type=int, default=32, help="tokens per generation (32)")
    ap.add_argument("-m", "--model", type=Path, default=None,
                    help="GGUF (default: a small generated qwen3moe with stage routing)")
    ap.add_argument("--json", type=output_file, default=None, help="write the figures here")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    model = a.model or ensure_model(ModelSpec(arch="qwen3moe", expert_type="q4_0", n_expert=16,
                                              n_expert_used=2, planted=STAGE_PLANT))
    r = soak(model, a.generations, a.n_predict, not a.quiet)
    figures = {**asdict(r), "rss_growth": r.rss_growth, "failures": r.failures(),
               "bounds": {"rss_growth": RSS_GROWTH_BOUND, "fds": FD_GROWTH_BOUND,
                          "threads": THREAD_GROWTH_BOUND}}
    figures["cache_errors"] = r.cache_errors[:20]
    text = json.dumps(figures, indent=2)
    if a.json:
        write_text_atomic(a.json, text)
    print(text)
    return 1 if r.failures() else 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
