"""Trace files: round trip, validation, and clear errors for corrupt or mismatched files."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from saem_gguf.errors import SaemError
from saem_gguf.trace import (
    TRACE_FORMAT_VERSION, ModelSignature, SequenceTrace, TraceError, TraceSet, load_traces, read_header,
    save_traces, validate_traces,
)

SIG = ModelSignature(arch="qwen3moe", n_layer=2, n_expert=6, n_expert_used=2, expert_bytes=1234, name="tiny")


def _seq(T: int, seed: int, weights: bool = True, prompt: int = 0, starts=(0,)) -> SequenceTrace:
    rng = np.random.default_rng(seed)
    ex = np.argsort(rng.random((T, 2, 6)), axis=2)[:, :, :2].astype(np.int16)
    w = rng.random((T, 2, 2)).astype(np.float32) if weights else None
    pieces = [bytes([65 + (i % 26)]) * (i % 3) for i in range(T)]
    if T:
        pieces[0] = "é".encode()[:1]  # a piece that splits a UTF-8 character
    return SequenceTrace(token_ids=np.arange(T, dtype=np.int32) + seed, pieces=pieces, experts=ex, weights=w,
                         stage_starts=np.array(starts, np.int32), prompt_len=prompt)


def _set() -> TraceSet:
    return TraceSet(signature=SIG, sequences=[_seq(7, 1, prompt=2, starts=(0, 3, 5)), _seq(4, 2, weights=False),
                                              _seq(0, 3, weights=False)],
                    source="engine", meta={"note": "hand-made", "boundary_cues": [[None, "Wait", None], [None], [None]]})


def test_round_trip(tmp_path):
    ts = _set()
    p = tmp_path / "t.npz"
    save_traces(ts, str(p))
    back = load_traces(str(p), expect=SIG)
    assert back.signature == SIG and back.source == "engine" and back.meta == ts.meta
    assert len(back.sequences) == 3
    for a, b in zip(ts.sequences, back.sequences):
        assert np.array_equal(a.token_ids, b.token_ids) and a.pieces == b.pieces
        assert np.array_equal(a.experts, b.experts) and b.experts.dtype == np.int16
        assert (a.weights is None) == (b.weights is None)
        if a.weights is not None:
            assert np.array_equal(a.weights, b.weights)
        assert np.array_equal(a.stage_starts, b.stage_starts) and a.prompt_len == b.prompt_len
    hdr = read_header(str(p))
    assert hdr["format"] == "saem-trace" and hdr["version"] == TRACE_FORMAT_VERSION and hdr["n_tokens"] == 11
    # a prompt's tokens are not decoded ones
    assert [s.decoded_tokens for s in back.sequences] == [5, 4, 0] and back.decoded_tokens == 9


def test_round_trip_synthetic(tmp_path):
    synthetic = pytest.importorskip("saem_gguf.synthetic")
    ts = synthetic.make_stage_traces(synthetic.SyntheticConfig(n_layer=3, n_expert=8, top_k=2, n_sequences=2,
                                                               stage_len_scale=0.2, seed=3))
    p = tmp_path / "s.npz"
    save_traces(ts, str(p))
    back = load_traces(str(p))
    assert [s.n_tokens for s in back.sequences] == [s.n_tokens for s in ts.sequences]
    assert all(np.array_equal(a.experts, b.experts) for a, b in zip(ts.sequences, back.sequences))
    assert back.meta["boundary_cues"] == [[c for c in cues] for cues in ts.meta["boundary_cues"]]


@pytest.mark.parametrize("mutate, msg", [
    (lambda s: setattr(s.sequences[0], "experts", s.sequences[0].experts + 10), "out of range"),
    (lambda s: setattr(s.sequences[0], "stage_starts", np.array([1], np.int32)), "start with 0"),
    (lambda s: setattr(s.sequences[0], "stage_starts", np.array([0, 4, 4], np.int32)), "strictly increasing"),
    (lambda s: setattr(s.sequences[0], "stage_starts", np.array([0, 9], np.int32)), "strictly increasing"),
    (lambda s: s.sequences[0].pieces.pop(), "text pieces"),
    (lambda s: setattr(s.sequences[0], "experts", s.sequences[0].experts[:, :1]), "experts shape"),
    (lambda s: setattr(s.sequences[0], "prompt_len", 99), "prompt_len"),
    (lambda s: s.sequences[0].weights.__setitem__((0, 0, 0), np.nan), "NaN"),
    (lambda s: s.sequences[0].experts.__setitem__((1, 1), [3, 3]), "same expert twice"),
])
def test_validation_rejects(mutate, msg, tmp_path):
    ts = _set()
    mutate(ts)
    with pytest.raises(TraceError, match=msg):
        validate_traces(ts)
    with pytest.raises(SaemError):  # never reaches the disk
        save_traces(ts, str(tmp_path / "bad.npz"))
    assert not (tmp_path / "bad.npz").exists()


def _rewrite(src, dst, change):
    """Copy an npz, letting change(dict of arrays) edit it."""
    with np.load(src, allow_pickle=False) as z:
        a = {k: z[k] for k in z.files}
    change(a)
    np.savez(dst, **a)


def _set_header(a, **kw):
    h = json.loads(bytes(a["header"]).decode())
    h.update(kw)
    a["header"] = np.frombuffer(json.dumps(h).encode(), np.uint8)


@pytest.mark.parametrize("change, msg", [
    (lambda a: _set_header(a, version=TRACE_FORMAT_VERSION + 1), "newer than this reader"),
    (lambda a: _set_header(a, format="other"), "not a saem trace"),
    (lambda a: _set_header(a, n_tokens=3), "corrupt trace"),
    (lambda a: a.pop("experts"), "missing experts"),
    (lambda a: a.__setitem__("experts", a["experts"][:, :1]), "corrupt trace"),
    (lambda a: a.__setitem__("seq_offsets", a["seq_offsets"][::-1].copy()), "corrupt trace"),
    (lambda a: a.__setitem__("experts", (a["experts"] + 7).astype(np.int16)), "out of range"),
    (lambda a: a.__setitem__("header", np.frombuffer(b"{not json", np.uint8)), "corrupt trace header"),
    (lambda a: a.pop("header"), "no header"),
])
def test_corrupt_files_rejected(tmp_path, change, msg):
    good = tmp_path / "good.npz"
    save_traces(_set(), str(good))
    bad = tmp_path / "bad.npz"
    _rewrite(str(good), str(bad), change)
    with pytest.raises(TraceError, match=msg):
        load_traces(str(bad))


def test_truncated_and_garbage_files(tmp_path):
    good = tmp_path / "good.npz"
    save_traces(_set(), str(good))
    data = good.read_bytes()
    for i, blob in enumerate((data[: len(data) // 2], b"hello world", b"")):
        p = tmp_path / f"bad{i}.npz"
        p.write_bytes(blob)
        with pytest.raises(TraceError, match=str(p)):
            load_traces(str(p))
    # flip bytes inside the compressed routing: zip CRC or shape checks must catch it
    buf = bytearray(data)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = z.getinfo("experts.npy")
    off = info.header_offset + 30 + len(info.filename) + len(info.extra) + 40
    for j in range(off, min(off + 16, len(buf))):
        buf[j] ^= 0xFF
    p = tmp_path / "flipped.npz"
    p.write_bytes(bytes(buf))
    with pytest.raises(TraceError):
        load_traces(str(p))
    with pytest.raises(TraceError, match="no such trace file"):
        load_traces(str(tmp_path / "missing.npz"))


def test_signature_mismatch(tmp_path):
    p = tmp_path / "t.npz"
    save_traces(_set(), str(p))
    for other in (ModelSignature("qwen3moe", 3, 6, 2), ModelSignature("qwen3moe", 2, 8, 2),
                  ModelSignature("qwen3moe", 2, 6, 4), ModelSignature("gpt-oss", 2, 6, 2)):
        with pytest.raises(TraceError, match="model mismatch"):
            load_traces(str(p), expect=other)
