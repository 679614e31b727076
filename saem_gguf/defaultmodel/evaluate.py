"""Evaluate the default model with llama.cpp: held-out accuracy, stage cues, and stage coherence.

    python -m saem_gguf.defaultmodel.evaluate [-n 200] [--model PATH] [--json OUT]

For each held-out problem (``corpus.heldout_examples``: operand tuples training never saw) the
model answers greedily through llama.cpp; a reply counts as correct when its ``Answer: N`` line
after ``</think>`` holds the right N. Stages are cut where the qwen3 cue set's matcher fires on the
generated pieces. TCseq (``saem_gguf.stage.coherence.tcseq``) uses the routing of the generated
tokens, computed by the NumPy reference forward over the same GGUF; it is compared with the
same tokens shuffled three ways (same stage bounds each time; several permutations each):

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

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from saem_gguf.defaultmodel import corpus, reference
from saem_gguf.defaultmodel.bpe import Tokenizer

ANSWER_RE = re.compile(r"</think>\s*\n\s*Answer:\s*(-?\d+)\s*$")
CUE_SET = "qwen3"


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

    cues = load_cues(CUE_SET)
    events = find_cues(cues, [tok.piece(i) for i in ids])
    opener: dict[int, str] = {}
    for c, t in events:
        if 0 < t < len(ids):
            opener.setdefault(t, cues[c].text)
    cuts = sorted(opener)
    return (np.array([0] + cuts + [len(ids)], np.int64), [cues[c].text for c, _ in events],
            [""] + [opener[t] for t in cuts])


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
    """TCseq of the replies' own routing, and of the same tokens shuffled (``n_perm``
    permutations for the ``rows`` and ``pooled`` baselines, ``n_text_perm`` re-routed text
    shuffles): each baseline's mean, std and max over its permutations, and how many standard
    deviations the real TCseq lies above the mean."""
    from saem_gguf.stage.coherence import capacity_of, tcseq

    rng = np.random.default_rng(seed)
    E = weights.n_expert
    use = [r for r in replies if len(r.bounds) > 2]  # at least one transition
    routes = [routing_of(weights, r.prompt_ids, r.gen_ids) for r in use]
    bounds = [r.bounds for r in use]

    def score(segs) -> float:
        return tcseq(segs, E, capacity_ratio).overall

    real = tcseq(list(zip(routes, bounds)), E, capacity_ratio)
    base: dict[str, list[float]] = {"rows": [], "pooled": [], "text": []}
    for _ in range(n_perm):
        base["rows"].append(score([(ex[rng.permutation(len(ex))], b) for ex, b in zip(routes, bounds)]))
        pool = np.concatenate(routes)[rng.permutation(sum(len(x) for x in routes))]
        segs, at = [], 0
        for ex, b in zip(routes, bounds):
            segs.append((pool[at:at + len(ex)], b))
            at += len(ex)
        base["pooled"].append(score(segs))
    text_routes: list[np.ndarray] = []
    for _ in range(n_text_perm):
        segs = []
        for r in use:
            perm = rng.permutation(len(r.gen_ids))
            segs.append((routing_of(weights, r.prompt_ids, [r.gen_ids[i] for i in perm]), r.bounds))
        text_routes += [x for x, _ in segs]
        base["text"].append(score(segs))
    cap = capacity_of(E, capacity_ratio)
    res: dict = {"real": real.to_dict(), "n_sequences": len(use), "capacity_ratio": capacity_ratio,
                 "concentration": {"real": round(top_share(routes, E, cap), 4),
                                   "text": round(top_share(text_routes, E, cap), 4)}}
    for name, vals in base.items():
        if not vals:
            continue
        v = np.array(vals)
        sd = float(v.std(ddof=1)) if len(v) > 1 else float("nan")
        res[name] = {"mean": round(float(v.mean()), 6), "std": round(sd, 6), "max": round(float(v.max()), 6),
                     "n_perm": len(v),
                     "z": round((real.overall - v.mean()) / sd, 2) if sd and np.isfinite(sd) and sd > 0 else None}
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


def summarise(replies: list[Reply]) -> dict:
    n = len(replies)
    by_kind: dict[str, list[int]] = {}
    for r in replies:
        by_kind.setdefault(r.example.kind, [0, 0])
        by_kind[r.example.kind][0] += r.correct
        by_kind[r.example.kind][1] += 1
    n_stages = [len(r.bounds) - 1 for r in replies]
    return {
        "n": n,
        "accuracy": sum(r.correct for r in replies) / n,
        "with_think": sum(r.has_think for r in replies) / n,
        "with_cue_in_think": sum(bool(r.think_cues) for r in replies) / n,
        "with_answer_line": sum(r.answer is not None for r in replies) / n,
        "well_formed": sum(r.has_think and bool(r.think_cues) and r.answer is not None for r in replies) / n,
        "mean_stages": float(np.mean(n_stages)),
        "mean_reply_tokens": float(np.mean([len(r.gen_ids) for r in replies])),
        "by_kind": {k: f"{c}/{t}" for k, (c, t) in sorted(by_kind.items())},
    }


def main(argv=None) -> int:
    from saem_gguf.default_model import default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("-n", type=int, default=200, help="held-out problems")
    p.add_argument("--seed", type=int, default=12345, help="held-out draw seed")
    p.add_argument("--capacity", type=float, default=0.25, help="ECR for TCseq")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--show", type=int, default=3, help="print this many replies")
    a = p.parse_args(argv)
    path = a.model or default_model_path()
    t0 = time.time()
    replies = run_replies(path, corpus.heldout_examples(a.n, seed=a.seed))
    t_gen = time.time() - t0
    summ = summarise(replies)
    weights = reference.load_weights(path)
    coh = coherence(weights, replies, a.capacity)
    kinds = kind_overlap(weights, replies)
    for r in replies[:a.show]:
        print(f"--- {r.example.question}  (expected {r.example.answer})\n{r.text}")
    out = {"model": str(path), "heldout_seed": a.seed, **summ, "tcseq": coh, "stage_kinds": kinds,
           "generation_seconds": round(t_gen, 1)}
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
