"""Evaluate the default model: the held-out evaluation of the model contract, and v1's replay.

    python -m saem_gguf.defaultmodel.evaluate [--model PATH] [--seed 14] [--per-kind 12]
        [--conversations 40] [--ood 20] [--json OUT]

runs ``saem_gguf.defaultmodel.eval`` (held-out phrasings, multi-turn conversations and
out-of-domain turns through saem_gguf's public ``Llama``; stage statistics; TCseq against shuffled
baselines with z) and prints the table by kind and turn; docs/DEFAULT_MODEL.md, "Evaluation".

The functions below are the first model's single-turn replay (``corpus.heldout_examples`` read
back through llama.cpp, routing from the NumPy reference), kept for ``tests/test_default_model.py``
and ``bench/bench_stage_kinds.py``. ``coherence`` compares TCseq with the same tokens shuffled
three ways (same stage bounds each time; several permutations each):

* ``rows``:   each sequence's per-token routing rows permuted (order within the reply destroyed),
* ``text``:   each reply's tokens permuted and re-routed by the model (prompt kept),
* ``pooled``: routing rows pooled over all replies, permuted, and dealt back.

``rows`` is the order test proper: every token keeps the routing it had in its real context. The
``text`` baseline also changes the routing itself: in shuffled text the model routes by token
identity more than by context, so a reply's routing concentrates on fewer experts and every
TCseq over it rises, whatever the order. ``concentration`` reports that confound: the mean share
of a reply's routing slots on its own top-C experts (C = the TCseq cache), for the real replies
and for the shuffled, re-routed ones.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from saem_gguf.defaultmodel import reference
from saem_gguf.defaultmodel.bpe import Tokenizer
from saem_gguf.defaultmodel.eval.scoring import CUE_SET

if TYPE_CHECKING:  # the corpus is the first model's; the v2 evaluation does not depend on it
    from saem_gguf.defaultmodel import corpus

ANSWER_RE = re.compile(r"</think>\s*\n\s*Answer:\s*(-?\d+)\s*$")


def open_llama(model_path: str | Path, n_ctx: int = 1024):
    from saem_gguf.llama_lib import load_llama_cpp

    llama_cpp = load_llama_cpp()
    return llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=512, logits_all=True,
                           verbose=False, seed=0)


def greedy(llm, prompt_tokens: list[int], stop_id: int, max_new: int = 400) -> list[int]:
    """Greedy continuation from llama.cpp's own logits (stop token excluded)."""
    llm.reset()
    llm.eval(prompt_tokens)
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if nxt == stop_id:
            break
        out.append(nxt)
        llm.eval([nxt])
    return out


@dataclass
class Reply:
    example: corpus.Example
    prompt_ids: list[int]
    gen_ids: list[int]
    text: str
    answer: int | None
    bounds: np.ndarray  # stage bounds over gen_ids (S + 1 entries)
    cues: list[str]  # cue texts found, in order
    openers: list[str]  # per stage, the cue text that opened it ("" for the first)

    @property
    def correct(self) -> bool:
        return self.answer == self.example.answer

    @property
    def has_think(self) -> bool:
        return self.text.startswith("<think>") and "</think>" in self.text

    @property
    def think_cues(self) -> list[str]:
        return [c for c in self.cues if c not in ("<think>", "</think>")]


# stage kind of each qwen3 cue, as the corpus uses them (corpus.py); the first stage is "compute"
CUE_KIND = {"Wait": "pause", "But wait": "pause", "Hmm": "pause", "Hold on": "pause", "Okay, so": "pause",
            "Alternatively": "alternative", "Another way": "alternative", "Instead": "alternative",
            "Let me verify": "verify", "Let me check": "verify", "Let me double-check": "verify",
            "Let me recheck": "verify", "Therefore": "conclude", "So the answer": "conclude",
            "</think>": "answer"}


def stage_bounds(tok: Tokenizer, ids: list[int]) -> tuple[np.ndarray, list[str], list[str]]:
    """(stage bounds, every cue text found in order, the cue text opening each stage: "" for the
    first, the first cue matched at a cut for the others)."""
    from saem_gguf.stage.cues import load_cues
    from saem_gguf.stage.matcher import find_cues

    from saem_gguf.defaultmodel.eval.stages import cut_at_cues

    cues = load_cues(CUE_SET)
    events = find_cues(cues, [tok.piece(i) for i in ids])
    stages = cut_at_cues(events, cues, len(ids))
    return stages.bounds, [cues[c].text for c, _ in events], list(stages.openers)


def answer_of(text: str) -> int | None:
    m = ANSWER_RE.search(text)
    return int(m.group(1)) if m else None


def run_replies(model_path: str | Path, examples: list[corpus.Example], llm=None) -> list[Reply]:
    tok = Tokenizer.from_gguf(model_path)
    llm = llm or open_llama(model_path)
    stop = tok.id_of("<|im_end|>")
    out = []
    for ex in examples:
        p = llm.tokenize(ex.prompt.encode(), add_bos=False, special=True)
        g = greedy(llm, p, stop)
        text = tok.decode(g)
        out.append(Reply(ex, p, g, text, answer_of(text), *stage_bounds(tok, g)))
    return out


def routing_of(weights: reference.GGUFWeights, prompt_ids: list[int], gen_ids: list[int]) -> np.ndarray:
    """[len(gen_ids), L, k] expert ids of the generated tokens (prompt as context)."""
    _, r = reference.forward(weights, list(prompt_ids) + list(gen_ids))
    return r[len(prompt_ids):]


def top_share(routes: list[np.ndarray], n_expert: int, cap: int) -> float:
    """Mean over replies and layers of the share of routing slots on the reply's top-``cap``
    experts (routes: [T, L, k] expert ids per reply)."""
    from saem_gguf.stage.coherence import stage_histogram, transition_coherence

    shares = [transition_coherence(h, h, cap) for h in (stage_histogram(r, n_expert) for r in routes)]
    return float(np.mean(shares)) if shares else float("nan")


def coherence(weights: reference.GGUFWeights, replies: list[Reply], capacity_ratio: float = 0.25,
              n_perm: int = 20, n_text_perm: int = 2, seed: int = 0) -> dict:
    """TCseq of the replies' own routing against the ``rows`` and ``pooled`` baselines
    (``eval.tcseq_baselines``, ``n_perm`` permutations each) and ``n_text_perm`` re-routed text
    shuffles: each baseline's mean, std and max over its permutations, and z."""
    from saem_gguf.defaultmodel.eval.tcseq_baselines import baseline_summary, tcseq_with_baselines
    from saem_gguf.stage.coherence import capacity_of, tcseq

    E = weights.n_expert
    use = [r for r in replies if len(r.bounds) > 2]  # at least one transition
    routes = [routing_of(weights, r.prompt_ids, r.gen_ids) for r in use]
    res = tcseq_with_baselines(routes, [r.bounds for r in use], E, capacity_ratio, n_perm, seed)
    rng = np.random.default_rng(seed + 1)
    text_routes: list[np.ndarray] = []
    text_scores: list[float] = []
    for _ in range(n_text_perm):
        segs = []
        for r in use:
            perm = rng.permutation(len(r.gen_ids))
            segs.append((routing_of(weights, r.prompt_ids, [r.gen_ids[i] for i in perm]), r.bounds))
        text_routes += [x for x, _ in segs]
        text_scores.append(tcseq(segs, E, capacity_ratio).overall)
    cap = capacity_of(E, capacity_ratio)
    res["concentration"] = {"real": round(top_share(routes, E, cap), 4),
                            "text": round(top_share(text_routes, E, cap), 4)}
    if text_scores:
        res["text"] = baseline_summary(res["real"]["overall"], text_scores)
    return res


def stage_kinds(reply: Reply) -> list[str]:
    """The kind of every stage of ``reply`` (by the cue that opens it; the first is "compute")."""
    return ["compute"] + [CUE_KIND.get(c, "other") for c in reply.openers[1:]]


def kind_overlap(weights: reference.GGUFWeights, replies: list[Reply], top: int = 8) -> dict:
    """How much the stage kinds share their experts: per kind and layer the ``top`` most-used
    experts over all replies' stages of that kind; for each pair of kinds the mean over layers
    of the size of the intersection (``top`` = the same experts, 0 = disjoint)."""
    from saem_gguf.stage.coherence import stage_histograms, top_experts

    hist: dict[str, np.ndarray] = {}
    for r in replies:
        stages = stage_histograms(routing_of(weights, r.prompt_ids, r.gen_ids), r.bounds, weights.n_expert)
        for kind, h in zip(stage_kinds(r), stages):
            hist[kind] = hist.get(kind, 0) + h
    tops = {k: [set(row.tolist()) for row in top_experts(h, top)] for k, h in hist.items()}
    kinds = sorted(tops)
    L = weights.n_layer
    pairs = {f"{a}-{b}": round(float(np.mean([len(tops[a][layer] & tops[b][layer]) for layer in range(L)])), 2)
             for i, a in enumerate(kinds) for b in kinds[i + 1:]}
    return {"top": top, "tokens": {k: int(hist[k][0].sum() // weights.n_expert_used) for k in kinds},
            "shared": pairs}


def main(argv=None) -> int:
    from saem_gguf.defaultmodel.eval.cli import main as eval_main

    return eval_main(argv)


if __name__ == "__main__":
    sys.exit(main())
