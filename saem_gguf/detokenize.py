"""Token ids to text as llama.cpp writes it: every piece whole.

llama-cpp-python's ``LlamaModel.detokenize`` asks ``llama_token_to_piece`` for each token into a
32-byte buffer. A longer piece does not fit, llama.cpp returns minus the size it needs and writes
nothing, and ``bytes(buffer[:n])`` with that negative n is empty: the token's text is dropped
(llama-cpp-python issue #2362). Qwen2/Qwen3 vocabularies hold such tokens (runs of 64 spaces,
long code tokens), so indented code loses its indentation. llama.cpp's own tools
(``common_token_to_piece``) grow the buffer; so does ``token_piece`` here, and ``detokenize``
otherwise keeps llama-cpp-python's rule (a leading space after BOS is dropped).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

_FIRST_TRY = 64  # bytes: nearly every piece fits; a longer one is asked for again at its size


def token_piece(lc, vocab, token: int, special: bool, buf=None) -> bytes:
    """llama.cpp's ``common_token_to_piece``: the token's text, whatever its length (``lc`` the
    llama_cpp module, ``buf`` an optional scratch buffer reused across calls)."""
    if buf is None:
        buf = ctypes.create_string_buffer(_FIRST_TRY)
    n = lc.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:  # it needs -n bytes
        buf = ctypes.create_string_buffer(-n)
        n = lc.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[:n]


def detokenize(lc, vocab, tokens: Iterable[int], special: bool, bos: int) -> bytes:
    """llama-cpp-python's ``LlamaModel.detokenize`` with every piece whole."""
    tokens = list(tokens)
    buf = ctypes.create_string_buffer(_FIRST_TRY)
    out = b"".join(token_piece(lc, vocab, t, special, buf) for t in tokens)
    return out[1:] if tokens and tokens[0] == bos and out[:1] == b" " else out
