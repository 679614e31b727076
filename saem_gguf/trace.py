"""Routing traces in memory: what was decoded, and which experts each token used in each layer.

This is the in-memory contract shared by the stage detector (calibration), the policies and the
simulator, and the engine that records traces. File I/O (reader, writer, validation) lives here too.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
from dataclasses import dataclass, field

import numpy as np

from saem_gguf.errors import SaemError
from saem_gguf.fileio import atomic_open


@dataclass
class ModelSignature:
    """Identifies the routing shape a trace belongs to; a trace only replays on a matching model."""

    arch: str
    n_layer: int  # MoE layers in the trace (dense layers are not traced)
    n_expert: int
    n_expert_used: int
    expert_bytes: int = 0  # bytes of one expert in one layer (gate+up+down), 0 when unknown
    name: str = ""


@dataclass
class SequenceTrace:
    """One generated sequence. T tokens, L MoE layers, K = n_expert_used."""

    token_ids: np.ndarray  # int32 [T]
    pieces: list[bytes]  # UTF-8 text piece of each token, len T (may split characters)
    experts: np.ndarray  # int16 [T, L, K]: top-k expert ids per token and layer
    weights: np.ndarray | None = None  # float32 [T, L, K] gate weights when known
    stage_starts: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int32))  # int32 [S], first is 0
    prompt_len: int = 0  # tokens [0, prompt_len) are the prompt (prefill)

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def decoded_tokens(self) -> int:
        """Tokens decoded after the prompt."""
        return self.n_tokens - int(self.prompt_len)


@dataclass
class TraceSet:
    signature: ModelSignature
    sequences: list[SequenceTrace]
    source: str = "synthetic"  # "synthetic" | "engine"
    meta: dict = field(default_factory=dict)

    @property
    def decoded_tokens(self) -> int:
        """The sequences' decoded tokens (their prompts left out)."""
        return sum(sq.decoded_tokens for sq in self.sequences)


# --------------------------------------------------------------------------------------------
# File format (see docs/POLICIES.md, "Trace files")
#
# One ``.npz`` per run, written without pickles. Per-sequence arrays are concatenated and
# indexed by offsets so a file holds any number of sequences in a fixed set of entries:
#
#   header          uint8 [n]        UTF-8 JSON: format, version, signature, source, meta, counts
#   token_ids       int32 [N]        N = total tokens over all sequences
#   seq_offsets     int64 [n_seq+1]  tokens of sequence i are [seq_offsets[i], seq_offsets[i+1])
#   experts         int16 [N, L, K]
#   weights         float32 [N, L, K] (only when some sequence has gate weights)
#   weights_mask    bool [n_seq]     which sequences' weights are real
#   piece_bytes     uint8 [P]        text pieces concatenated
#   piece_offsets   int64 [N+1]
#   stage_starts    int32 [n_stages] all sequences' stage starts, concatenated
#   stage_offsets   int64 [n_seq+1]
#   prompt_len      int32 [n_seq]
#
# A token's position is its index within its sequence. Stage events are stage_starts[1:]
# (stage_starts[0] is always 0, the start of the sequence).


TRACE_FORMAT = "saem-trace"
TRACE_FORMAT_VERSION = 1
_REQUIRED = ("header", "token_ids", "seq_offsets", "experts", "piece_bytes", "piece_offsets",
             "stage_starts", "stage_offsets", "prompt_len", "weights_mask")


class TraceError(SaemError):
    """A trace file or in-memory trace that is corrupt, inconsistent or for another model."""


def validate_traces(ts: TraceSet, where: str = "trace") -> None:
    """Raise TraceError (one line saying what and where) unless ``ts`` is self-consistent."""
    sig = ts.signature
    if not isinstance(sig, ModelSignature):
        raise TraceError(f"{where}: signature is not a ModelSignature")
    if sig.n_layer < 1 or sig.n_expert < 1 or not 1 <= sig.n_expert_used <= sig.n_expert:
        raise TraceError(f"{where}: bad signature n_layer={sig.n_layer} n_expert={sig.n_expert} "
                         f"n_expert_used={sig.n_expert_used}")
    if sig.n_expert > np.iinfo(np.int16).max:
        raise TraceError(f"{where}: n_expert={sig.n_expert} does not fit int16 expert ids")
    L, E, K = sig.n_layer, sig.n_expert, sig.n_expert_used
    for i, s in enumerate(ts.sequences):
        w = f"{where}: sequence {i}"
        T = s.n_tokens
        if s.token_ids.ndim != 1:
            raise TraceError(f"{w}: token_ids must be 1-D")
        if len(s.pieces) != T:
            raise TraceError(f"{w}: {len(s.pieces)} text pieces for {T} tokens")
        if any(not isinstance(p, (bytes, bytearray)) for p in s.pieces):
            raise TraceError(f"{w}: text pieces must be bytes")
        if s.experts.shape != (T, L, K):
            raise TraceError(f"{w}: experts shape {s.experts.shape} != (tokens, n_layer, n_expert_used) = {(T, L, K)}")
        if not np.issubdtype(s.experts.dtype, np.integer):
            raise TraceError(f"{w}: experts must be integers, got {s.experts.dtype}")
        if T and (int(s.experts.min()) < 0 or int(s.experts.max()) >= E):
            raise TraceError(f"{w}: expert id out of range [0, {E}) "
                             f"(min {int(s.experts.min())}, max {int(s.experts.max())})")
        if T and K > 1:
            srt = np.sort(s.experts, axis=2)
            if np.any(srt[:, :, 1:] == srt[:, :, :-1]):
                t, l, _ = np.argwhere(srt[:, :, 1:] == srt[:, :, :-1])[0]
                raise TraceError(f"{w}: token {t} layer {l} routes the same expert twice")
        if s.weights is not None:
            if s.weights.shape != (T, L, K):
                raise TraceError(f"{w}: weights shape {s.weights.shape} != {(T, L, K)}")
            if T and not np.all(np.isfinite(s.weights)):
                raise TraceError(f"{w}: weights contain NaN or inf")
        st = np.asarray(s.stage_starts)
        if st.ndim != 1 or st.size < 1 or int(st[0]) != 0:
            raise TraceError(f"{w}: stage_starts must be 1-D and start with 0")
        if np.any(np.diff(st) <= 0) or (T and int(st[-1]) >= T) or (not T and st.size > 1):
            raise TraceError(f"{w}: stage_starts must be strictly increasing and < n_tokens ({T})")
        if not 0 <= int(s.prompt_len) <= T:
            raise TraceError(f"{w}: prompt_len {s.prompt_len} outside [0, {T}]")


def check_signature(ts: TraceSet, expected: ModelSignature, where: str = "trace") -> None:
    """Raise TraceError unless ``ts`` has the routing shape (and arch) of ``expected``."""
    got = ts.signature
    for k in ("n_layer", "n_expert", "n_expert_used"):
        if getattr(got, k) != getattr(expected, k):
            raise TraceError(f"{where}: model mismatch: trace has {k}={getattr(got, k)}, "
                             f"expected {getattr(expected, k)}")
    if expected.arch and got.arch and got.arch != expected.arch:
        raise TraceError(f"{where}: model mismatch: trace arch {got.arch!r}, expected {expected.arch!r}")
    if expected.expert_bytes and got.expert_bytes and got.expert_bytes != expected.expert_bytes:
        raise TraceError(f"{where}: model mismatch: expert_bytes {got.expert_bytes} != {expected.expert_bytes}")


def save_traces(ts: TraceSet, path: str, compress: bool = True) -> None:
    """Write ``ts`` to ``path`` (.npz). Validates first, so a bad trace never reaches disk."""
    data = traces_to_bytes(ts, compress)
    # Built in memory, then written atomically: a failure never leaves a half-written file.
    with atomic_open(path, "wb") as f:
        f.write(data)


def traces_to_bytes(ts: TraceSet, compress: bool = True) -> bytes:
    """``ts`` in the trace file format (validated first): what ``save_traces`` writes, and what a
    profile embeds of its calibration routing (stage.calibrate)."""
    validate_traces(ts)
    seqs = ts.sequences
    lens = np.array([s.n_tokens for s in seqs], np.int64)
    seq_off = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(lens, out=seq_off[1:])
    sig = ts.signature
    L, K = sig.n_layer, sig.n_expert_used
    N = int(seq_off[-1])
    experts = np.concatenate([s.experts.astype(np.int16) for s in seqs]) if seqs else np.zeros((0, L, K), np.int16)
    token_ids = np.concatenate([s.token_ids.astype(np.int32) for s in seqs]) if seqs else np.zeros(0, np.int32)
    pieces = [p for s in seqs for p in s.pieces]
    plen = np.fromiter((len(p) for p in pieces), np.int64, N)
    piece_off = np.zeros(N + 1, np.int64)
    np.cumsum(plen, out=piece_off[1:])
    piece_bytes = np.frombuffer(b"".join(bytes(p) for p in pieces), np.uint8)
    starts = [np.asarray(s.stage_starts, np.int32) for s in seqs]
    st_off = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([a.size for a in starts], out=st_off[1:])
    mask = np.array([s.weights is not None for s in seqs], bool)
    arrays = {
        "token_ids": token_ids, "seq_offsets": seq_off, "experts": experts,
        "piece_bytes": piece_bytes, "piece_offsets": piece_off,
        "stage_starts": np.concatenate(starts) if starts else np.zeros(0, np.int32),
        "stage_offsets": st_off, "prompt_len": np.array([s.prompt_len for s in seqs], np.int32),
        "weights_mask": mask,
    }
    if mask.any():
        arrays["weights"] = np.concatenate([
            s.weights.astype(np.float32) if s.weights is not None else np.zeros((s.n_tokens, L, K), np.float32)
            for s in seqs])
    from saem_gguf import __version__

    header = {
        "format": TRACE_FORMAT, "version": TRACE_FORMAT_VERSION, "writer": f"saem_gguf {__version__}",
        "signature": dataclasses.asdict(sig), "source": ts.source, "n_sequences": len(seqs),
        "n_tokens": N, "meta": ts.meta,
    }
    try:
        hdr = json.dumps(header, default=_json_default).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TraceError(f"trace meta is not JSON-serialisable: {e}") from None
    arrays["header"] = np.frombuffer(hdr, np.uint8)
    buf = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buf, **arrays)
    return buf.getvalue()


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (bytes, bytearray)):
        return o.decode("utf-8", "replace")
    raise TypeError(f"{type(o).__name__} is not JSON-serialisable")


def read_header(path: str) -> dict:
    """The JSON header of a trace file (cheap: does not decode the routing)."""
    with _open_npz(path) as z:
        return _header(z, path)


def _open_npz(path: str):
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such trace file")
    if os.path.isdir(path):
        raise TraceError(f"{path}: is a directory, not a trace file")
    return _load_npz(path, path)


def _load_npz(source, where: str):
    # A trace is a zip archive of arrays. np.load reads anything else as a bare .npy array (a
    # different type, no header entry) or, failing that, says the file holds pickled data and
    # suggests allow_pickle: so what is not a zip archive is refused before np.load sees it.
    try:
        if not zipfile.is_zipfile(source):
            raise TraceError(f"{where}: not a saem trace (.npz) file: not a zip archive")
        if not isinstance(source, str):
            source.seek(0)
        return np.load(source, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise TraceError(f"{where}: not a saem trace (.npz) file: {e}") from None


def _header(z, path: str) -> dict:
    if "header" not in z.files:
        raise TraceError(f"{path}: not a saem trace: no header entry")
    try:
        hdr = json.loads(bytes(z["header"]).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, zipfile.BadZipFile, OSError) as e:
        raise TraceError(f"{path}: corrupt trace header ({e})") from None
    if not isinstance(hdr, dict) or hdr.get("format") != TRACE_FORMAT:
        raise TraceError(f"{path}: not a saem trace (format {hdr.get('format') if isinstance(hdr, dict) else '?'!r})")
    v = hdr.get("version")
    if not isinstance(v, int) or v < 1:
        raise TraceError(f"{path}: bad trace format version {v!r}")
    if v > TRACE_FORMAT_VERSION:
        raise TraceError(f"{path}: trace format version {v} is newer than this reader ({TRACE_FORMAT_VERSION}); "
                         "upgrade saem_gguf")
    return hdr


def load_traces(path: str, expect: ModelSignature | None = None) -> TraceSet:
    """Read a trace file written by ``save_traces``; validates it, and checks the model
    signature against ``expect`` when given. Any problem raises TraceError with the path."""
    return _read(_open_npz(path), path, expect)


def traces_from_bytes(data: bytes, where: str, expect: ModelSignature | None = None) -> TraceSet:
    """``load_traces`` of ``traces_to_bytes``' output; TraceError naming ``where``."""
    return _read(_load_npz(io.BytesIO(data), where), where, expect)


def _read(npz, path: str, expect: ModelSignature | None) -> TraceSet:
    with npz as z:
        hdr = _header(z, path)
        missing = [k for k in _REQUIRED if k not in z.files]
        if missing:
            raise TraceError(f"{path}: corrupt trace: missing {', '.join(missing)}")
        try:
            a = {k: z[k] for k in z.files if k != "header"}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
            raise TraceError(f"{path}: corrupt trace data ({e})") from None
    try:
        sig = ModelSignature(**hdr["signature"])
    except (KeyError, TypeError) as e:
        raise TraceError(f"{path}: bad signature in header ({e})") from None
    n = hdr.get("n_sequences")
    L, K = sig.n_layer, sig.n_expert_used
    seq_off, st_off, piece_off = a["seq_offsets"], a["stage_offsets"], a["piece_offsets"]

    def bad(msg: str):
        return TraceError(f"{path}: corrupt trace: {msg}")

    if not isinstance(n, int) or seq_off.shape != (n + 1,) or st_off.shape != (n + 1,):
        raise bad("sequence count does not match the offsets")
    for name, off, total in (("seq_offsets", seq_off, a["token_ids"].shape[0]),
                             ("stage_offsets", st_off, a["stage_starts"].shape[0]),
                             ("piece_offsets", piece_off, a["piece_bytes"].shape[0])):
        if off.ndim != 1 or off.size < 1 or off[0] != 0 or off[-1] != total or np.any(np.diff(off) < 0):
            raise bad(f"{name} inconsistent with data")
    N = int(seq_off[-1])
    if hdr.get("n_tokens") != N or a["experts"].shape != (N, L, K) or piece_off.shape != (N + 1,):
        raise bad(f"experts shape {a['experts'].shape} / token count do not match header (N={N}, L={L}, K={K})")
    if a["prompt_len"].shape != (n,) or a["weights_mask"].shape != (n,):
        raise bad("per-sequence arrays have the wrong length")
    has_w = bool(a["weights_mask"].any())
    if has_w and ("weights" not in a or a["weights"].shape != (N, L, K)):
        raise bad("weights missing or of the wrong shape")
    pb = a["piece_bytes"].tobytes()
    seqs = []
    for i in range(n):
        t0, t1 = int(seq_off[i]), int(seq_off[i + 1])
        pieces = [pb[int(piece_off[j]):int(piece_off[j + 1])] for j in range(t0, t1)]
        seqs.append(SequenceTrace(
            token_ids=a["token_ids"][t0:t1].astype(np.int32),
            pieces=pieces,
            experts=a["experts"][t0:t1].astype(np.int16),
            weights=a["weights"][t0:t1].astype(np.float32) if a["weights_mask"][i] else None,
            stage_starts=a["stage_starts"][int(st_off[i]):int(st_off[i + 1])].astype(np.int32),
            prompt_len=int(a["prompt_len"][i]),
        ))
    ts = TraceSet(signature=sig, sequences=seqs, source=str(hdr.get("source", "engine")),
                  meta=hdr.get("meta") or {})
    validate_traces(ts, where=path)
    if expect is not None:
        check_signature(ts, expect, where=path)
    return ts
