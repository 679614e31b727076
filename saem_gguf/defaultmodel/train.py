"""Train the default model and write its GGUF (PyTorch CPU: a development-only dependency).

    python -m saem_gguf.defaultmodel.train --out saem_gguf/data/default-model.gguf

The recipe has two phases, each on freshly generated training sequences (corpus v4; see
docs/DEFAULT_MODEL.md). The loss is over the last reply, its reading tokens (where it restates
the question) weighted ``--reading-weight`` times the rest:

1. 300 steps x 8 sequences, peak LR 3e-3: learns the format (the BPE is trained here);
2. 3400 steps x 8 sequences (new data, seed + 1), LR re-warmed to 2e-3 and cosine-decayed
   to 10 %: learns to copy operands, the column arithmetic and the follow-ups.

A sequence is one turn of a conversation with its history (about 475 tokens on average), so a
step sees about 3,800 tokens. docs/DEFAULT_MODEL.md gives the measured run time.

Deterministic for a given seed and thread count (2 by default): corpus, BPE merges, batch order
and initialisation all derive from ``--seed``. Each phase saves WORK_DIR/phaseN.pt (model state,
config, tokenizer); ``--resume`` skips the phases whose checkpoint is already there, which gives
the same result as running them (nothing carries over between phases but the weights and the
tokenizer). Progress goes to stdout and WORK_DIR/train.log. ``--tiny`` is a seconds-long smoke
run of the whole pipeline.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from saem_gguf.defaultmodel import bpe, corpus

DEFAULTS = dict(n_layer=6, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff_exp=64, n_expert=32,
                n_expert_used=4)
TINY = dict(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff_exp=64, n_expert=32,
            n_expert_used=4)


@dataclass(frozen=True)
class Phase:
    steps: int
    batch: int
    lr: float
    warmup: int
    seed_offset: int  # corpus and batch-order seed = --seed + seed_offset


PHASES = (Phase(steps=300, batch=8, lr=3e-3, warmup=30, seed_offset=0),
          Phase(steps=3400, batch=8, lr=2e-3, warmup=50, seed_offset=1))
TINY_PHASES = (Phase(steps=20, batch=8, lr=3e-3, warmup=5, seed_offset=0),
               Phase(steps=10, batch=8, lr=2e-3, warmup=5, seed_offset=1))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("saem_gguf/data/default-model.gguf"))
    p.add_argument("--work-dir", type=Path, default=Path("out/defaultmodel"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="skip phases whose checkpoint exists in WORK_DIR")
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--reading-weight", type=float, default=3.0,
                   help="loss weight of a reply's reading tokens (where it restates the question), the rest 1")
    p.add_argument("--max-len", type=int, default=1024, help="drop longer sequences (tokens)")
    p.add_argument("--bpe-examples", type=int, default=3000)
    p.add_argument("--vocab-size", type=int, default=1536, help="upper bound (merges stop at frequency < 2)")
    p.add_argument("--expert-type", default="q8_0", choices=("q8_0", "q4_0"))
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="smoke test: tiny model, few steps")
    p.add_argument("--phase-steps", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="override each phase's step count (comma-separated; for short pilot runs)")
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {v}")
    a = p.parse_args(argv)
    if a.tiny:
        a.bpe_examples, a.log_every = 500, 5
    return a


def batches(lengths: np.ndarray, batch: int, steps: int, rng: np.random.Generator):
    """Index batches of similar lengths: shuffle, sort within chunks of 32 batches, shuffle batches."""
    out: list[np.ndarray] = []
    while len(out) < steps:
        perm = rng.permutation(len(lengths))
        chunk = batch * 32
        for s in range(0, len(perm) - batch + 1, chunk):
            part = perm[s:s + chunk]
            part = part[np.argsort(lengths[part], kind="stable")]
            bs = [part[i:i + batch] for i in range(0, len(part) - batch + 1, batch)]
            out.extend(bs[j] for j in rng.permutation(len(bs)))
    return out[:steps]


def run_phase(model, seqs: list[np.ndarray], plen: list[int], rlen: list[int], lengths: np.ndarray, ph: Phase,
              rng: np.random.Generator, a: argparse.Namespace, log) -> tuple[float, float]:
    """Train ``model`` for one phase on the encoded conversations; returns (final CE EMA, seconds)."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=ph.lr, betas=(0.9, 0.95))

    def lr_at(step: int, ph=ph) -> float:
        if step < ph.warmup:
            return ph.lr * (step + 1) / ph.warmup
        frac = (step - ph.warmup) / max(1, ph.steps - ph.warmup)
        return ph.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    plan = batches(lengths, ph.batch, ph.steps, rng)
    ema, seen = None, 0
    t_phase = time.time()
    for step, bidx in enumerate(plan):
        T = int(lengths[bidx].max())
        ids = torch.zeros((len(bidx), T), dtype=torch.long)
        mask = torch.zeros((len(bidx), T), dtype=torch.bool)
        tgt_mask = torch.zeros((len(bidx), T - 1), dtype=torch.bool)
        weight = torch.zeros((len(bidx), T - 1))
        for r, i in enumerate(bidx):
            n = len(seqs[i])
            ids[r, :n] = torch.from_numpy(seqs[i])
            mask[r, :n] = True
            tgt_mask[r, plen[i] - 1:n - 1] = True  # predict the assistant turn only
            weight[r, plen[i] - 1:n - 1] = 1.0
            weight[r, plen[i] - 1:plen[i] - 1 + rlen[i]] = a.reading_weight
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits, aux = model(ids, mask)
        nll = torch.nn.functional.cross_entropy(logits[:, :-1][tgt_mask], ids[:, 1:][tgt_mask], reduction="none")
        ce = nll.detach().mean()  # what is logged: every reply token alike
        w = weight[tgt_mask]
        loss = (nll * w).sum() / w.sum() + a.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += int(mask.sum())
        ema = ce.item() if ema is None else 0.95 * ema + 0.05 * ce.item()
        if step % a.log_every == 0 or step == ph.steps - 1:
            el = time.time() - t_phase
            log(f"step {step:5d}/{ph.steps}  ce {ce.item():.4f}  ema {ema:.4f}  aux {aux.item():.3f}  "
                f"lr {lr_at(step):.2e}  {seen / max(el, 1e-9):.0f} tok/s")
    return ema, time.time() - t_phase


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from saem_gguf.defaultmodel.bpe import Tokenizer
    from saem_gguf.defaultmodel.export import export_gguf
    from saem_gguf.defaultmodel.model import Config, MoEModel

    t0 = time.time()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True)
    a.work_dir.mkdir(parents=True, exist_ok=True)
    log_f = open(a.work_dir / "train.log", "a" if a.resume else "w")

    def log(msg: str) -> None:
        line = f"[{time.time() - t0:7.1f}s] {msg}"
        print(line, flush=True)
        log_f.write(line + "\n")
        log_f.flush()

    phases = TINY_PHASES if a.tiny else PHASES
    if a.phase_steps:
        phases = tuple(replace(ph, steps=n) for ph, n in zip(phases, a.phase_steps))
    model = tok = None
    total_steps, train_s, ema = 0, 0.0, None
    for pi, ph in enumerate(phases, 1):
        ckpt = a.work_dir / f"phase{pi}.pt"
        if a.resume and ckpt.exists():
            ck = torch.load(ckpt, map_location="cpu", weights_only=False)
            tok = Tokenizer.from_json(ck["tokenizer"])
            model = MoEModel(Config(**ck["config"]))
            model.load_state_dict(ck["state"])
            total_steps += ck["steps"]
            train_s += ck["train_seconds"]
            ema = ck["final_ce_ema"]
            log(f"phase {pi}: resumed from {ckpt} ({ck['steps']} steps, {ck['train_seconds']:.0f} s, ce ema {ema:.4f})")
            continue
        seed = a.seed + ph.seed_offset
        rng = np.random.default_rng(seed)
        # corpus: enough distinct conversations for every step to see new ones
        examples = corpus.training_examples(ph.steps * ph.batch + 1000, seed=seed)
        if tok is None:
            tok = bpe.train_bpe([e.text for e in examples[:a.bpe_examples]], vocab_size=a.vocab_size)
            log(f"BPE: {len(tok.merges)} merges, vocab {tok.size}")
        seqs, plen, rlen = [], [], []
        for e in examples:
            p, c = tok.encode(e.prompt), tok.encode(e.completion)
            if len(p) + len(c) <= a.max_len:
                seqs.append(np.array(p + c, np.int64))
                plen.append(len(p))
                # the reading's tokens are the reply's first ones (it ends at a pre-token boundary:
                # checked on 3,000 sequences of seed 1, docs/DEFAULT_MODEL.md)
                rlen.append(len(tok.encode(e.reading_completion)))
        lengths = np.array([len(s) for s in seqs])
        log(f"phase {pi}: {ph}; corpus seed {seed}: {len(seqs)} of {len(examples)} conversations kept "
            f"(<= {a.max_len} tokens), {int(lengths.sum())} tokens, mean {lengths.mean():.1f}")
        if model is None:
            arch = TINY if a.tiny else DEFAULTS
            cfg = Config(n_vocab=tok.size, **{k: (getattr(a, k) if getattr(a, k) is not None else v)
                                               for k, v in arch.items()})
            model = MoEModel(cfg)
            log(f"model: {json.dumps(cfg.to_dict())}; {model.n_params():,} parameters")
        ema, ph_s = run_phase(model, seqs, plen, rlen, lengths, ph, rng, a, lambda m, pi=pi: log(f"phase {pi} {m}"))
        train_s += ph_s
        total_steps += ph.steps
        log(f"phase {pi}: {ph.steps} steps in {ph_s:.0f} s ({ph_s / 60:.1f} min); ce ema {ema:.4f}")
        torch.save({"config": model.c.to_dict(), "state": model.state_dict(), "tokenizer": tok.to_json(),
                    "args": {k: str(v) for k, v in vars(a).items()}, "phase": pi, "final_ce_ema": ema,
                    "steps": ph.steps, "train_seconds": ph_s}, ckpt)

    cfg = model.c
    log(f"trained {total_steps} steps in {train_s:.0f} s ({train_s / 60:.1f} min); final ce ema {ema:.4f}")
    path = export_gguf(model, tok, a.out, expert_type=a.expert_type, seed=a.seed,
                       description=f"saem_gguf default model: {cfg.n_layer}-layer qwen3moe, "
                                   f"{cfg.n_expert} experts top-{cfg.n_expert_used}, trained on generated "
                                   f"chain-of-thought arithmetic ({total_steps} steps, seed {a.seed})")
    log(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB); total {time.time() - t0:.0f} s")
    log_f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
