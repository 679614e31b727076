"""Run evaluation conversations the way a user does: saem_gguf's public ``Llama``,
``create_chat_completion`` at temperature 0 with the model's own chat template, every full reply
appended to the message list (as ``chat`` keeps its history; the template decides what of an
earlier reply the model sees)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from saem_gguf.defaultmodel.eval.problems import Turn
from saem_gguf.defaultmodel.eval.scoring import Score, score_reply

MAX_N_CTX = 4096  # the context used: the model's training context, at most this
DEFAULT_MAX_TOKENS = 1024  # per reply; a reply that runs out is scored as it stands


@dataclass
class TurnResult:
    turn: Turn
    position: int  # 1-based turn number in its conversation
    n_turns: int  # turns in its conversation
    reply: str  # the message content create_chat_completion returned
    finish_reason: str  # "stop" or "length"
    prompt_ids: list[int]  # the rendered conversation so far, as the model saw it
    gen_ids: list[int]  # the reply's tokens the model evaluated (all of them unless "length")
    gen_pieces: list[bytes]  # the text piece of each of gen_ids (special tokens as text)
    score: Score

    @property
    def correct(self) -> bool:
        return self.score.correct(self.turn.answer)

    @property
    def well_formed(self) -> bool:
        return self.score.well_formed(self.turn.in_domain)


def context_size(model_path: str | Path) -> int:
    """The model's training context (``{arch}.context_length``), at most MAX_N_CTX."""
    from saem_gguf.gguf_info import read_model_info

    n = read_model_info(model_path).n_ctx_train
    return min(n, MAX_N_CTX) if n > 0 else MAX_N_CTX


def open_model(model_path: str | Path, n_ctx: int, n_threads: int | None = None):
    """The public ``Llama`` over ``model_path`` (placement never changes greedy output, so the
    default policy serves)."""
    from saem_gguf.api import Llama

    return Llama(str(model_path), n_ctx=n_ctx, n_threads=n_threads, seed=0, verbose=False)


def run_conversation(llm, turns: Sequence[Turn], max_tokens: int = DEFAULT_MAX_TOKENS) -> list[TurnResult]:
    messages: list[dict] = []
    out: list[TurnResult] = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn.question})
        done = llm.create_chat_completion(messages, temperature=0.0, max_tokens=max_tokens)
        choice = done["choices"][0]
        reply = choice["message"]["content"] or ""
        n_prompt = done["usage"]["prompt_tokens"]
        # llama-cpp-python's context now holds the prompt and every reply token it evaluated
        # (each sampled token is evaluated before the next is drawn; the stop token never is)
        ids = [int(t) for t in llm.input_ids[:llm.n_tokens]]
        gen = ids[n_prompt:]
        out.append(TurnResult(turn, i + 1, len(turns), reply, choice["finish_reason"], ids[:n_prompt], gen,
                              [llm.detokenize([t], special=True) for t in gen], score_reply(reply)))
        messages.append({"role": "assistant", "content": reply})
    return out
