"""Summaries of scored turns (by kind, by turn, out of domain) and the printed table."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from saem_gguf.defaultmodel.eval.problems import FOLLOW_UP, OUT_OF_DOMAIN, SINGLE, SINGLE_KINDS
from saem_gguf.defaultmodel.eval.run import TurnResult


def tally(results: Sequence[TurnResult]) -> dict:
    """n, correct (in domain: the right answer; out of domain: a refusal), well formed, and the
    rates of both."""
    n = len(results)
    correct = sum(r.correct for r in results)
    formed = sum(r.well_formed for r in results)
    return {"n": n, "correct": correct, "well_formed": formed,
            "correct_rate": round(correct / n, 4) if n else None,
            "well_formed_rate": round(formed / n, 4) if n else None}


def _group(results: Sequence[TurnResult], key: Callable[[TurnResult], str | None]) -> dict[str, dict]:
    groups: dict[str, list[TurnResult]] = {}
    for r in results:
        k = key(r)
        if k is not None:
            groups.setdefault(k, []).append(r)
    return {k: tally(v) for k, v in groups.items()}


def summarise(single: Sequence[TurnResult], conversations: Sequence[TurnResult],
              out_of_domain: Sequence[TurnResult]) -> dict:
    """The figures of the issue's acceptance (``headline``) and their breakdowns."""
    in_conv = [r for r in conversations if r.turn.in_domain]
    ood_all = list(out_of_domain) + [r for r in conversations if not r.turn.in_domain]
    everything = list(single) + list(conversations) + list(out_of_domain)
    by_kind = _group(single, lambda r: r.turn.kind)
    return {
        "headline": {
            "single_turn_accuracy": tally(single)["correct_rate"],
            "later_turn_accuracy": tally([r for r in in_conv if r.position >= 2])["correct_rate"],
            "out_of_domain_refusal": tally(ood_all)["correct_rate"],
            "well_formed": tally(everything)["well_formed_rate"],
        },
        "single_turn": {"by_kind": {k: by_kind[k] for k in SINGLE_KINDS if k in by_kind}, "all": tally(single)},
        "conversations": {
            "by_turn": _group(in_conv, lambda r: f"turn {r.position}"),
            "by_turn_and_role": _group(conversations, lambda r: f"turn {r.position} {turn_label(r)}"),
            # a follow-up's computation (previous answer op x) is held out where some x allows it
            "follow_ups_held_out": sum(r.turn.heldout for r in in_conv if r.turn.role == FOLLOW_UP),
            "follow_ups": sum(r.turn.role == FOLLOW_UP for r in in_conv),
        },
        "out_of_domain": {
            "single": tally(out_of_domain),
            "first_turn": tally([r for r in conversations if not r.turn.in_domain and r.position == 1]),
            "later_turn": tally([r for r in conversations if not r.turn.in_domain and r.position > 1]),
        },
    }


def turn_label(r: TurnResult) -> str:
    if r.turn.kind == OUT_OF_DOMAIN:
        return "out-of-domain"
    return r.turn.role if r.turn.role != SINGLE else r.turn.kind


def table(summary: dict) -> str:
    """The summary as a plain-text table: one row per group, correct (or refused) and well formed."""
    rows: list[tuple[str, dict]] = []
    rows += [(f"single  {k}", v) for k, v in summary["single_turn"]["by_kind"].items()]
    rows.append(("single  all", summary["single_turn"]["all"]))
    rows += [(f"conv    {k}", v) for k, v in sorted(summary["conversations"]["by_turn_and_role"].items())]
    rows += [(f"conv    {k} (in domain)", v) for k, v in sorted(summary["conversations"]["by_turn"].items())]
    rows += [(f"ood     {k}", v) for k, v in summary["out_of_domain"].items()]
    width = max(len(label) for label, _ in rows)
    lines = [f"{'':{width}}  {'n':>4}  {'correct':>13}  {'well formed':>13}"]
    for label, t in rows:
        if not t["n"]:
            continue
        lines.append(f"{label:{width}}  {t['n']:4d}  {t['correct']:4d} ({t['correct_rate']:.3f})  "
                     f"{t['well_formed']:4d} ({t['well_formed_rate']:.3f})")
    h = summary["headline"]
    lines.append("")
    lines += [f"{k}: {v}" for k, v in h.items()]
    lines.append("(out of domain, 'correct' = a well-formed refusal that mentions arithmetic)")
    return "\n".join(lines)
