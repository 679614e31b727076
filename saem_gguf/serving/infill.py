"""llama-server's fill-in-the-middle prompt (POST /infill, what editor plugins such as llama.vim and
llama.vscode send): the code before and after the cursor and other files as context, laid out in
the model's FIM tokens the way llama-server's ``format_prompt_infill`` lays them out
(tools/server/server-common.cpp of the vendored source), so the same request gives the same prompt
tokens, and a greedy answer the same tokens, as llama-server on the same GGUF.

The repository-level layout (arXiv 2409.12186), where the model has the tokens:

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n chunk 0 ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix [FIM_SUF]suffix [FIM_MID]prompt

Budgets as llama-server's: the prefix keeps its last ``3 * (n_batch / 4)`` tokens, the suffix its
first ``n_batch / 4 - 2 - len(prompt)``, the extra context its last ``n_ctx - n_batch - 2 *
n_predict`` (``n_batch``, ``n_predict`` the server's -b and -n, not the request's: with -n -1 and
-c equal to -b that is 2 tokens). ``--spm-infill`` puts the suffix first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

NO_TOKEN = -1  # LLAMA_TOKEN_NULL

# a chunk separator where the model has no file-separator token, in llama-server's bytes
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"
# llama-server's fixed names (its TODOs: a project name and the current file's name as inputs)
REPO_NAME = "myproject\n"
CURRENT_FILE = "filename\n"


@dataclass(frozen=True)
class FimTokens:
    """The vocabulary's fill-in-the-middle tokens (NO_TOKEN where it has none): prefix, suffix and
    middle are required for /infill; repository and file separator are used where present."""

    pre: int = NO_TOKEN
    suf: int = NO_TOKEN
    mid: int = NO_TOKEN
    rep: int = NO_TOKEN
    sep: int = NO_TOKEN

    def missing(self) -> str:
        """llama-server's reason a model cannot infill ('' when it can)."""
        return "".join(f"{what} token is missing. " for what, tok in
                       (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if tok == NO_TOKEN)


@dataclass(frozen=True)
class InfillLimits:
    """The server's settings the layout budgets from: -b, -n and a slot's context."""

    n_batch: int
    n_predict: int
    n_ctx: int
    spm: bool = False  # --spm-infill: suffix/prefix/middle instead of prefix/suffix/middle


def infill_tokens(tokenize: Callable[[str | list[str | int]], list[int]], fim: FimTokens, limits: InfillLimits,
                  prefix: str | list[str | int], suffix: str | list[str | int],
                  extra: Sequence[tuple[str, str]], prompt_tokens: list[int], bos: int | None) -> list[int]:
    """The /infill prompt. ``tokenize``: text (or strings and token ids mixed, llama-server's
    ``tokenize_mixed``) to tokens, no BOS, special-token text kept literal; ``extra``: (filename,
    text) per context file; ``prompt_tokens``: the request's prompt, tokenized already; ``bos``:
    the BOS token when the vocabulary adds one, else None."""
    extra_tokens: list[int] = []
    if fim.rep != NO_TOKEN:
        extra_tokens += [fim.rep, *tokenize(REPO_NAME)]
    for filename, text in extra:
        if fim.sep != NO_TOKEN:
            extra_tokens += [fim.sep, *tokenize(filename + "\n")]
        else:
            extra_tokens += tokenize(CHUNK_SEPARATOR)
        extra_tokens += tokenize(text)
    if fim.sep != NO_TOKEN:
        extra_tokens += [fim.sep, *tokenize(CURRENT_FILE)]

    tokens_prefix, tokens_suffix = tokenize(prefix), tokenize(suffix)
    quarter = limits.n_batch // 4  # C++ integer division; n_batch >= 1
    n_prefix_take = min(len(tokens_prefix), 3 * quarter)
    n_suffix_take = min(len(tokens_suffix), max(0, quarter - (2 + len(prompt_tokens))))
    n_extra_take = min(max(0, limits.n_ctx - limits.n_batch - 2 * limits.n_predict), len(extra_tokens))

    head = [fim.pre, *tokens_prefix[len(tokens_prefix) - n_prefix_take:], *prompt_tokens]
    tail = [fim.suf, *tokens_suffix[:n_suffix_take]]
    first, second = (tail, head) if limits.spm else (head, tail)
    if bos is not None:
        first = [bos, *first]
    # the extra context goes before everything, BOS included, as llama-server puts it
    kept = extra_tokens[len(extra_tokens) - n_extra_take:]
    return [*kept, *first, *second, fim.mid]
