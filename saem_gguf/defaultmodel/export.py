"""Trained PyTorch state -> GGUF (qwen3moe, quantized experts, ChatML template), via testmodels' writer.

    python -m saem_gguf.defaultmodel.export --checkpoint out/defaultmodel/checkpoint.pt \\
        --out saem_gguf/data/default-model.gguf [--expert-type q8_0|q4_0]

Tensor kinds: token embedding, attention and output matrices F16; norms and the router F32;
the expert tensors ``--expert-type`` (Q8_0 by default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MODEL_NAME = "saem-default-reasoning-moe"
N_CTX_TRAIN = 2048  # trained on sequences of <= 1024 tokens; RoPE base 10000


def spec_for(cfg, expert_type: str, seed: int = 0):
    from saem_gguf.testmodels.spec import ModelSpec

    return ModelSpec(arch="qwen3moe", n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                     n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, n_ff_exp=cfg.n_ff_exp,
                     n_expert=cfg.n_expert, n_expert_used=cfg.n_expert_used, expert_type=expert_type,
                     n_ctx_train=N_CTX_TRAIN, seed=seed, name=MODEL_NAME)


def export_gguf(model, tok, out: Path, expert_type: str = "q8_0", description: str = "", seed: int = 0) -> Path:
    from saem_gguf.defaultmodel.corpus import CHAT_TEMPLATE
    from saem_gguf.testmodels.writer import write_gguf

    spec = spec_for(model.c, expert_type, seed)
    path = write_gguf(Path(out), spec, tok.to_vocab(), model.gguf_tensors(), name=MODEL_NAME,
                      description=description or "saem_gguf default model", chat_template=CHAT_TEMPLATE)
    path.chmod(0o644)  # the writer's temporary file is private; this one ships in the package
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=Path("out/defaultmodel/checkpoint.pt"))
    p.add_argument("--out", type=Path, default=Path("saem_gguf/data/default-model.gguf"))
    p.add_argument("--expert-type", default="q8_0", choices=("q8_0", "q4_0", "f16"))
    a = p.parse_args(argv)
    import torch

    from saem_gguf.defaultmodel.bpe import Tokenizer
    from saem_gguf.defaultmodel.model import Config, MoEModel

    ck = torch.load(a.checkpoint, map_location="cpu", weights_only=False)
    model = MoEModel(Config(**ck["config"]))
    model.load_state_dict(ck["state"])
    tok = Tokenizer.from_json(ck["tokenizer"])
    cfg = model.c
    desc = (f"saem_gguf default model: {cfg.n_layer}-layer qwen3moe, {cfg.n_expert} experts "
            f"top-{cfg.n_expert_used}, trained on generated chain-of-thought arithmetic "
            f"({ck.get('steps')} steps, seed {ck['args'].get('seed', 0)})")
    path = export_gguf(model, tok, a.out, a.expert_type, desc, seed=int(ck["args"].get("seed", 0)))
    print(f"{path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
