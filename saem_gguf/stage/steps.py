"""One decode step's inputs to the stage detectors, checked once: the sequence slots and the
routing rows. Shared by the cue matcher, the routing-shift detector and the detectors that run
both (``detector.py``, ``pair.py``)."""

from __future__ import annotations

import numpy as np

from saem_gguf.errors import SaemError

# NumPy's builtin dtypes are singletons: ``dtype is I64`` is true for every native int64 array and
# costs a pointer compare, where ``dtype != np.int64`` converts the type first (after a decode
# has emptied the caches that is microseconds per check; an equal dtype that is not the singleton
# only takes the slower, equally correct path)
I16 = np.dtype(np.int16)
I64 = np.dtype(np.int64)


def step_slots(seq_idx, distinct: bool = False) -> np.ndarray:
    """``seq_idx`` as one step's int64 [B] sequence slots; ``distinct``: a slot twice is refused
    (where cue and routing events are merged per slot, each slot must advance by one token)."""
    if type(seq_idx) is not np.ndarray or seq_idx.dtype is not I64 or seq_idx.ndim != 1:
        seq_idx = np.asarray(seq_idx, np.int64).reshape(-1)
    if distinct and seq_idx.shape[0] > 1 and len(set(seq_idx.tolist())) != seq_idx.shape[0]:
        raise SaemError("feed: a sequence slot appears twice in one step")
    return seq_idx


def check_pieces(pieces, B: int) -> None:
    """One step's text pieces: one per slot."""
    if len(pieces) != B:
        raise SaemError(f"feed: {B} sequence indices for {len(pieces)} pieces")


def routing_rows(experts, B: int, shape: tuple[int, int, int], where: str = "feed") -> np.ndarray:
    """``experts`` checked as one step's int16 [B, L, K] routing (``shape`` = (L, E, K));
    ``where`` names the call in the error."""
    if experts is None:
        raise SaemError(f"{where}: this detector detects routing shifts and needs the experts [B, L, K]")
    if type(experts) is not np.ndarray:
        experts = np.asarray(experts)
    if experts.shape != (B, shape[0], shape[2]):
        raise SaemError(f"{where}: experts must be [{B}, {shape[0]}, {shape[2]}], got {tuple(experts.shape)}")
    return experts if experts.dtype is I16 else experts.astype(np.int16)
