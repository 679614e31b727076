"""A small real byte-level BPE vocabulary for test models.

It is the head of Qwen2's vocabulary: the 256 byte tokens and the first N merges in rank order
(Qwen2's token 256+i is the result of merge i), so llama.cpp tokenizes with Qwen2's pre-tokenizer
and real merges, only with fewer of them. The derived file ships in saem_gguf/data/tokenizer/;
``python -m saem_gguf.testmodels.vocab SRC.gguf`` regenerates it from the llama.cpp source's
ggml-vocab-qwen2.gguf.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

VOCAB_FILE = "qwen2-bpe-3k.json"
N_MERGES = 3000

# (text, llama token type): CONTROL (3) tokens are not rendered as text; USER_DEFINED (4) are,
# so the stage detector sees "</think>" in the generated pieces.
SPECIAL_TOKENS = (
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<think>", 4),
    ("</think>", 4),
    # Gemma-style turn markup and BOS (the "gemma" chat template): <end_of_turn> ends a turn and
    # is not EOS, the case of a GGUF whose end-of-turn token differs from its EOS
    ("<bos>", 3),
    ("<start_of_turn>", 3),
    ("<end_of_turn>", 3),
)

# Fill-in-the-middle tokens of Qwen2.5-Coder / Qwen3-Coder (a model with ``ModelSpec.fim``): llama.cpp
# finds them by their text, as in those GGUFs, and serves /infill with them; the pad, repository
# and file-separator tokens are also end-of-generation tokens there
FIM_TOKENS = (
    ("<|fim_prefix|>", 3),
    ("<|fim_middle|>", 3),
    ("<|fim_suffix|>", 3),
    ("<|fim_pad|>", 3),
    ("<|repo_name|>", 3),
    ("<|file_sep|>", 3),
)

# gpt-oss's harmony markup (a model with the "gpt-oss" chat template): CONTROL tokens, as in its
# GGUFs. <|return|> is its EOS; with <|call|> there, llama.cpp takes <|end|> out of the
# end-of-generation tokens (it ends one message of an answer: the analysis, then the final one)
HARMONY_TOKENS = (
    ("<|start|>", 3),
    ("<|end|>", 3),
    ("<|message|>", 3),
    ("<|channel|>", 3),
    ("<|constrain|>", 3),
    ("<|return|>", 3),
    ("<|call|>", 3),
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma-like: the template writes {{ bos_token }} itself, roles are user/model, the system message
# is folded into the first user turn, and every turn ends with <end_of_turn> (an EOT that is not EOS)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# gpt-oss's own template (llama.cpp's models/templates/openai-gpt-oss-120b.jinja, OpenAI's)
GPT_OSS_TEMPLATE = resources.files("saem_gguf.data.templates").joinpath("gpt-oss.jinja").read_text(encoding="utf-8")

# the chat templates a test model can carry (ModelSpec.chat_template); "none" writes no template
CHAT_TEMPLATES = {"chatml": CHATML_TEMPLATE, "gemma": GEMMA_TEMPLATE, "gpt-oss": GPT_OSS_TEMPLATE, "none": None}


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    eos_id: int
    im_start_id: int
    im_end_id: int

    @property
    def size(self) -> int:
        return len(self.tokens)

    def id_of(self, text: str) -> int:
        return self.tokens.index(text)


@lru_cache(maxsize=4)
def load_vocab(fim: bool = False, harmony: bool = False) -> Vocab:
    """The test vocabulary; ``fim``: with the fill-in-the-middle tokens after the special ones;
    ``harmony``: with gpt-oss's, ``<|return|>`` the EOS."""
    data = json.loads(resources.files("saem_gguf.data.tokenizer").joinpath(VOCAB_FILE).read_text())
    tokens = list(data["tokens"])
    types = [1] * len(tokens)  # NORMAL
    for text, ttype in SPECIAL_TOKENS + (FIM_TOKENS if fim else ()) + (HARMONY_TOKENS if harmony else ()):
        tokens.append(text)
        types.append(ttype)
    # pad to a multiple of 64 rows: quantized output/embedding rows tile cleanly
    while len(tokens) % 64:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)  # UNUSED
    return Vocab(tuple(tokens), tuple(types), tuple(data["merges"]),
                 eos_id=tokens.index("<|return|>" if harmony else "<|im_end|>"), im_start_id=tokens.index("<|im_start|>"),
                 im_end_id=tokens.index("<|im_end|>"))


def derive(src_gguf: Path, n_merges: int = N_MERGES) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(src_gguf)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    vocab = list(tokens[:256])
    have = set(vocab)
    kept = []
    for m in merges:
        if len(kept) >= n_merges:
            break
        a, b = m.split(" ")
        if a in have and b in have and (a + b) not in have:
            kept.append(m)
            vocab.append(a + b)
            have.add(a + b)
    return {"source": "head of Qwen2 vocabulary (ggml-vocab-qwen2.gguf in llama.cpp 0c1e570)",
            "tokens": vocab, "merges": kept}


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "data" / "tokenizer" / VOCAB_FILE
    out.write_text(json.dumps(derive(Path(sys.argv[1])), ensure_ascii=False))
    print(out)
