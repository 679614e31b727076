"""The whole evaluation of a default-model GGUF: run the held-out sets, score them, and measure the
stages and the stage coherence of the in-domain replies."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from saem_gguf.build.source import sha256_file
from saem_gguf.defaultmodel.eval import problems, report, run, stages, tcseq_baselines
from saem_gguf.defaultmodel.eval.routing import RoutingReader
from saem_gguf.defaultmodel.eval.run import TurnResult


@dataclass(frozen=True)
class EvalConfig:
    model: Path
    seed: int = 14
    per_kind: int = 12  # single-turn problems of each kind
    n_conversations: int = 40  # three-turn conversations
    n_out_of_domain: int = 20  # single out-of-domain turns
    n_ctx: int | None = None  # None: run.context_size(model)
    max_tokens: int = run.DEFAULT_MAX_TOKENS
    capacity_ratio: float = 0.25  # TCseq's cache
    n_perm: int = 20  # permutations per TCseq baseline (0: no TCseq)
    n_threads: int | None = None


@dataclass
class EvalRun:
    single: list[TurnResult]
    conversations: list[TurnResult]
    out_of_domain: list[TurnResult]
    generation_seconds: float

    @property
    def in_domain(self) -> list[TurnResult]:
        return [r for r in self.single + self.conversations if r.turn.in_domain]


def n_ctx_of(cfg: EvalConfig) -> int:
    return cfg.n_ctx if cfg.n_ctx is not None else run.context_size(cfg.model)


def n_turns(cfg: EvalConfig) -> int:
    return cfg.per_kind * len(problems.SINGLE_KINDS) + 3 * cfg.n_conversations + cfg.n_out_of_domain


def run_sets(cfg: EvalConfig, progress: Callable[[int], None] | None = None) -> EvalRun:
    """Every conversation of the sets; ``progress`` is told how many turns each one ran."""
    sets = problems.make_sets(cfg.seed, cfg.per_kind, cfg.n_conversations, cfg.n_out_of_domain)
    llm = run.open_model(cfg.model, n_ctx_of(cfg), cfg.n_threads)
    t0 = time.perf_counter()
    try:
        def each(convs):
            out: list[TurnResult] = []
            for turns in convs:
                out += run.run_conversation(llm, turns, cfg.max_tokens)
                if progress:
                    progress(len(turns))
            return out

        single = each([(t,) for t in sets.single])
        convs = each([c.turns for c in sets.conversations])
        ood = each([(t,) for t in sets.out_of_domain])
    finally:
        llm.close()
    return EvalRun(single, convs, ood, time.perf_counter() - t0)


def stage_figures(cfg: EvalConfig, ev: EvalRun) -> dict:
    """Stage-length statistics and TCseq (with its shuffled baselines) of the in-domain replies."""
    replies = ev.in_domain
    cut = [stages.reply_stages(r.gen_pieces) for r in replies]
    out: dict = {"stages": stages.length_statistics(cut)}
    if cfg.n_perm > 0:
        reader = RoutingReader(cfg.model, n_ctx_of(cfg))
        try:
            routes = [reader.routing(r.prompt_ids, r.gen_ids) for r in replies]
            n_expert = reader.n_expert
        finally:
            reader.close()
        out["tcseq"] = tcseq_baselines.tcseq_with_baselines(routes, [c.bounds for c in cut], n_expert,
                                                           cfg.capacity_ratio, cfg.n_perm)
    return out


def failures(ev: EvalRun, limit: int) -> list[dict]:
    """Up to ``limit`` wrong or malformed turns, with their question and reply."""
    bad = [r for r in ev.single + ev.conversations + ev.out_of_domain if not (r.correct and r.well_formed)]
    return [{"question": r.turn.question, "kind": r.turn.kind, "turn": r.position, "expected": r.turn.answer,
             "reply": r.reply, "finish_reason": r.finish_reason} for r in bad[:limit]]


def evaluate(cfg: EvalConfig, progress: Callable[[int], None] | None = None, n_failures: int = 20) -> dict:
    ev = run_sets(cfg, progress)
    return {"model": str(cfg.model), "sha256": sha256_file(cfg.model), "seed": cfg.seed,
            "sizes": {"per_kind": cfg.per_kind, "conversations": cfg.n_conversations,
                      "out_of_domain": cfg.n_out_of_domain},
            **report.summarise(ev.single, ev.conversations, ev.out_of_domain),
            **stage_figures(cfg, ev),
            "reply_tokens_mean": round(sum(len(r.gen_ids) for r in ev.in_domain) / max(len(ev.in_domain), 1), 1),
            "generation_seconds": round(ev.generation_seconds, 1),
            "failures": failures(ev, n_failures)}
