"""What a generated test model is: architecture, sizes, quant types, routing plant, seed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from dataclasses import asdict, dataclass, field

EXPERT_TYPES = ("f16", "q8_0", "q4_0", "q4_k")
# the other weight matrices: f16, or q4_0, which llama.cpp loads into its extra buffer types as it
# would a real Q4_0 model's (AMX where the CPU has it, else a repacked layout on AVX2 CPUs)
MATRIX_TYPES = ("f16", "q4_0")

# Stage vocabulary of reasoning text (computing, checking, trying another way, concluding), each
# pinned to its own token group, so that routing on such text changes at stage boundaries.
STAGE_PLANT: tuple[tuple[tuple[str, ...], int], ...] = (
    (("compute", "first", "add", "sum", "subtract", "multiply", "tens", "ones", "carry", "borrow"), 0),
    (("check", "verify", "wait", "hold", "again", "matches", "correct", "confirm"), 1),
    (("alternatively", "another", "instead", "way", "try", "count", "split"), 2),
    (("therefore", "answer", "so", "final", "result", "left", "total"), 3),
)


@dataclass(frozen=True)
class ModelSpec:
    arch: str = "qwen3moe"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff_exp: int = 64
    n_ff_shexp: int = 64  # shared expert FFN size (architectures that have one)
    n_ff_dense: int = 128  # FFN size of dense layers (n_dense_lead > 0, or dense=True)
    n_expert: int = 8
    n_expert_used: int = 2
    n_dense_lead: int = 0  # leading dense FFN layers before the MoE ones (DeepSeek style)
    expert_type: str = "q8_0"
    # ffn_down_exps in another type ("" = expert_type), as Q4_K_M files store some layers' down
    # experts in Q6_K: a layer whose matrices llama.cpp repacks in part
    down_expert_type: str = ""
    # the matrices that are not experts: attention, shared experts, dense FFNs, embeddings, output
    matrix_type: str = "f16"
    n_ctx_train: int = 4096
    seed: int = 0
    # Planted routing: each vocabulary token belongs to one of n_expert // n_expert_used groups,
    # and each group prefers its own K experts in every layer (a different permutation per layer).
    # `planted` pins chosen words' tokens to chosen groups: ((("verify", "check"), 1), ...).
    planted: tuple[tuple[tuple[str, ...], int], ...] = ()
    routing_strength: float = 8.0  # router logit margin; large = routing follows the text
    dense: bool = False  # no experts at all (a dense model, for error paths)
    # >0: experts are copies of this many distinct random experts (big benchmark models are then
    # quick to write; routing lives in the router, so it is unaffected)
    expert_pool: int = 0
    name: str = ""
    # tokenizer.ggml.add_bos_token: llama.cpp (and llama-cpp-python's create_completion) put BOS
    # before a raw prompt when true, as for Gemma, Llama and Mixtral GGUFs
    add_bos_token: bool = False
    # "chatml" (the default), "gemma" (writes {{ bos_token }}, BOS <bos>, turns end with the EOT
    # <end_of_turn>, which is not EOS), "gpt-oss" (gpt-oss's own template and harmony tokens,
    # <|return|> the EOS) or "none" (no tokenizer.chat_template at all)
    chat_template: str = "chatml"
    # Qwen-Coder's fill-in-the-middle tokens in the vocabulary (testmodels.vocab.FIM_TOKENS): a model
    # llama-server and `serve` answer /infill for
    fim: bool = False
    extra: tuple[tuple[str, str], ...] = field(default=())  # arch-specific knobs, as strings

    def __post_init__(self) -> None:
        if self.expert_type not in EXPERT_TYPES:
            raise ValueError(f"expert_type must be one of {EXPERT_TYPES}, got {self.expert_type!r}")
        if self.down_expert_type not in ("", *EXPERT_TYPES):
            raise ValueError(f"down_expert_type must be one of {EXPERT_TYPES}, got {self.down_expert_type!r}")
        if self.matrix_type not in MATRIX_TYPES:
            raise ValueError(f"matrix_type must be one of {MATRIX_TYPES}, got {self.matrix_type!r}")
        from saem_gguf.testmodels.vocab import CHAT_TEMPLATES

        if self.chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"chat_template must be one of {sorted(CHAT_TEMPLATES)}, got {self.chat_template!r}")
        if not self.dense and not (0 < self.n_expert_used <= self.n_expert):
            raise ValueError("need 0 < n_expert_used <= n_expert")
        for kind in {self.expert_type, self.down_expert_type} - {""}:
            if self.n_embd % (256 if kind == "q4_k" else 32):
                raise ValueError(f"n_embd must be a multiple of the {kind} block size")
            if self.n_ff_exp % (256 if kind == "q4_k" else 32):
                raise ValueError(f"n_ff_exp must be a multiple of the {kind} block size")

    @property
    def n_groups(self) -> int:
        return max(1, self.n_expert // self.n_expert_used)

    def key(self) -> str:
        """Stable id of the spec and of the generator's code, for the file cache: editing an
        architecture module or the writer invalidates the cached files it made."""
        from saem_gguf.testmodels.writer import GENERATOR_VERSION

        blob = json.dumps({"v": GENERATOR_VERSION, "code": _generator_code_hash(self.arch),
                           **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def filename(self) -> str:
        kind = "dense" if self.dense else f"{self.n_expert}x{self.n_expert_used}-{self.expert_type}"
        return f"{self.name or self.arch}-L{self.n_layer}-{kind}-{self.key()}.gguf"


def _generator_code_hash(arch: str) -> str:
    here = Path(__file__).resolve().parent
    files = [here / n for n in ("weights.py", "writer.py", "quant.py", "vocab.py", "archs/base.py")]
    files.append(here / "archs" / f"{arch.replace('-', '')}.py")
    h = hashlib.sha256()
    for f in files:
        if f.exists():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]
