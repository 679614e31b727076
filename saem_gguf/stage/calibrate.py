"""Offline calibration: prune a candidate cue set into the model-specific set Tmodel, fit the
implicit detector's thresholds, and write both into a profile JSON the engine loads.

Input: routing traces (token pieces + per-token per-layer expert ids). The pruning rules (see
docs/STAGES.md for the exact definitions and defaults):

(a) marker frequency: a cue must occur at least ``min_count`` times, in at least
    ``min_seq_frac`` of the sequences, and at most ``max_rate_per_1k`` times per 1000 tokens;
(b) segmentation noise: segmenting by the cue alone, at most ``max_short_share`` of the
    resulting stages may be shorter than ``min_stage_tokens``;
(c) adjacent-stage coherence: segmenting by all cues that passed (a) and (b) (with the
    runtime minimum stage length), the cue's transitions must have TCseq >= ``min_tcseq``
    and >= ``min_tcseq_rel`` x the median cue's TCseq.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from saem_gguf.errors import SaemError
from saem_gguf.fileio import write_text_atomic
from saem_gguf.stage.coherence import (
    TCSeq,
    _summarise,
    capacity_of,
    stage_histogram,
    stage_histograms,
    transition_coherence,
)
from saem_gguf.stage.cues import CueSet
from saem_gguf.stage.implicit import ImplicitConfig, score_trace
from saem_gguf.stage.matcher import CueMatcher, compile_cues
from saem_gguf.trace import (
    ModelSignature, SequenceTrace, TraceSet, traces_from_bytes, traces_to_bytes,
)

PROFILE_FORMAT = "saem-stage-profile"
PROFILE_VERSION = 1


@dataclass
class CalibrationConfig:
    # (a) marker frequency
    min_count: int = 5
    min_seq_frac: float = 0.05
    max_rate_per_1k: float = 10.0
    # (b) segmentation noise
    min_stage_tokens: int = 32
    max_short_share: float = 0.25
    # (c) adjacent-stage coherence
    capacity_ratio: float = 0.25
    min_tcseq: float = 0.0
    min_tcseq_rel: float = 0.8
    # (d) optional, beyond the paper: the cue must mark a routing change. shift = TC within
    # the stage before the cue minus TC across the cue, on equal-sized windows (shift_window
    # tokens). None = not applied (still reported).
    min_shift: float | None = None
    shift_window: int = 64
    # Runtime minimum stage length written to the profile (default: min_stage_tokens).
    runtime_min_stage_tokens: int | None = None
    # Implicit detector: fit its thresholds on within-stage routing.
    fit_implicit: bool = True
    implicit: ImplicitConfig = field(default_factory=ImplicitConfig)
    # high = median + implicit_z_high * robust sd of the within-stage excess (low: z_low),
    # never below the ImplicitConfig values.
    implicit_z_high: float = 8.0
    implicit_z_low: float = 4.0

    def validate(self) -> None:
        if self.min_count < 0 or self.min_stage_tokens < 0:
            raise SaemError("min_count and min_stage_tokens must be >= 0")
        for name in ("min_seq_frac", "max_short_share", "min_tcseq", "min_tcseq_rel"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise SaemError(f"{name} must be in [0, 1], got {v}")
        if self.max_rate_per_1k <= 0 or not 0 < self.implicit_z_low <= self.implicit_z_high:
            raise SaemError("max_rate_per_1k must be > 0 and 0 < implicit_z_low <= implicit_z_high")
        if self.shift_window < 2:
            raise SaemError("shift_window must be >= 2")
        capacity_of(1000, self.capacity_ratio)
        self.implicit.validate()

    @property
    def runtime_min_stage(self) -> int:
        return self.min_stage_tokens if self.runtime_min_stage_tokens is None else self.runtime_min_stage_tokens


@dataclass
class Profile:
    """What calibration produced for one model: Tmodel, thresholds, statistics."""

    signature: ModelSignature
    cues: CueSet
    thresholds: dict
    implicit: ImplicitConfig | None = None
    stats: dict = field(default_factory=dict)
    version: int = PROFILE_VERSION
    # stats["calibration_routing"] decoded (checked at load): the calibration sample a policy is
    # replayed over at load (simulator.calibration_sample; None in a profile without one)
    routing: TraceSet | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict:
        return {
            "format": PROFILE_FORMAT,
            "version": self.version,
            "signature": asdict(self.signature),
            "cues": self.cues.to_dict(),
            "thresholds": self.thresholds,
            "implicit": None if self.implicit is None else self.implicit.to_dict(),
            "stats": _jsonable(self.stats, 6),
        }

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json.dumps(_jsonable(self.to_dict()), indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "profile", expect: ModelSignature | None = None) -> Profile:
        if not isinstance(d, dict):
            raise SaemError(f"{where}: expected a JSON object")
        if d.get("format") != PROFILE_FORMAT:
            raise SaemError(f"{where}: not a stage profile (format {d.get('format')!r}, expected {PROFILE_FORMAT!r})")
        ver = d.get("version")
        if ver != PROFILE_VERSION:
            raise SaemError(f"{where}: unsupported profile version {ver!r} (this build reads {PROFILE_VERSION})")
        for key in ("signature", "cues", "thresholds"):
            if key not in d:
                raise SaemError(f"{where}: missing {key!r}")
        sig = _signature_from(d["signature"], where)
        if expect is not None:
            mismatch = [k for k in ("arch", "n_layer", "n_expert", "n_expert_used")
                        if getattr(sig, k) != getattr(expect, k)]
            if mismatch:
                have = ", ".join(f"{k}={getattr(sig, k)}" for k in mismatch)
                want = ", ".join(f"{k}={getattr(expect, k)}" for k in mismatch)
                raise SaemError(f"{where}: profile is for another model ({have}; this model has {want})")
        # Calibration may keep no cue at all (implicit detection only).
        cues = CueSet.from_dict(d["cues"], where=f"{where}: cues", allow_empty=True)
        th = d["thresholds"]
        if not isinstance(th, dict):
            raise SaemError(f"{where}: thresholds must be an object")
        mst = th.get("min_stage_tokens", 0)
        if not isinstance(mst, int) or isinstance(mst, bool) or mst < 0:
            raise SaemError(f"{where}: thresholds.min_stage_tokens must be an integer >= 0")
        imp = d.get("implicit")
        implicit = None if imp is None else ImplicitConfig.from_dict(imp)
        stats = d.get("stats", {})
        if not isinstance(stats, dict):
            raise SaemError(f"{where}: stats must be an object")
        _check_stats(stats, sig, where)
        routing = stats.get("calibration_routing")
        routing = None if routing is None else decode_routing(routing, sig, f"{where}: stats.calibration_routing")
        return cls(sig, cues, th, implicit, stats, ver, routing)

    @classmethod
    def load(cls, path: str | Path, expect: ModelSignature | None = None) -> Profile:
        """Read and validate a profile; with ``expect``, refuse one made for another model."""
        p = Path(path)
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise SaemError(f"cannot read profile {p}: {e.strerror or e}") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SaemError(f"profile {p} is not valid JSON: {e}") from e
        return cls.from_dict(d, str(p), expect)


def _check_stats(stats: dict, sig: ModelSignature, where: str) -> None:
    """The statistics the engine reads as arrays: expert_counts (n_layer x n_expert, finite, >= 0)
    and cue_profiles' outline (its per-cue arrays are checked where they are read)."""
    counts = stats.get("expert_counts")
    if counts is not None:
        shape = (sig.n_layer, sig.n_expert)
        rows_ok = isinstance(counts, list) and len(counts) == shape[0] and all(
            isinstance(r, list) and len(r) == shape[1] for r in counts)
        if not rows_ok:
            raise SaemError(f"{where}: stats.expert_counts must be {shape[0]} lists of {shape[1]} "
                            "numbers (one per MoE layer and expert)")
        for row in counts:
            for v in row:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise SaemError(f"{where}: stats.expert_counts holds {v!r}: counts are finite "
                                    "numbers >= 0")
    profiles = stats.get("cue_profiles")
    if profiles is not None and not (isinstance(profiles, dict) and {"cues", "counts"} <= set(profiles)):
        raise SaemError(f"{where}: stats.cue_profiles must be an object with 'cues' and 'counts'")


def encode_routing(ts: TraceSet) -> str:
    """A calibration sample as the profile stores it (stats["calibration_routing"]): the trace
    file format (trace.traces_to_bytes, gate weights dropped: no policy reads them), base64."""
    bare = replace(ts, sequences=[replace(sq, weights=None) for sq in ts.sequences])
    return base64.b64encode(traces_to_bytes(bare)).decode("ascii")


def decode_routing(text, sig: ModelSignature, where: str) -> TraceSet:
    """``encode_routing``'s output read back and checked against the profile's model; SaemError
    naming ``where`` for anything else (a TraceError is one)."""
    if not isinstance(text, str):
        raise SaemError(f"{where}: must be a base64 string")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise SaemError(f"{where}: not base64 ({e})") from None
    ts = traces_from_bytes(data, where, expect=sig)
    if not ts.sequences:
        raise SaemError(f"{where}: holds no sequence")
    lengths = ts.meta.get("request_lengths")
    if lengths is not None:
        # every sampled request's whole decoded length (simulator.calibration_sample): at least
        # what the sample kept of it, else a replay at a batch would cut parts that do not exist
        ok = isinstance(lengths, list) and len(lengths) == len(ts.sequences) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= sq.decoded_tokens
            for n, sq in zip(lengths, ts.sequences))
        if not ok:
            raise SaemError(f"{where}: request_lengths must be one whole number per sequence, each at least "
                            "the tokens the sample decoded of it")
    return ts


def _signature_from(d, where: str) -> ModelSignature:
    if not isinstance(d, dict):
        raise SaemError(f"{where}: signature must be an object")
    try:
        sig = ModelSignature(
            arch=str(d["arch"]), n_layer=int(d["n_layer"]), n_expert=int(d["n_expert"]),
            n_expert_used=int(d["n_expert_used"]), expert_bytes=int(d.get("expert_bytes", 0)),
            name=str(d.get("name", "")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SaemError(f"{where}: bad signature ({e!r})") from e
    if min(sig.n_layer, sig.n_expert, sig.n_expert_used) < 1 or sig.n_expert_used > sig.n_expert:
        raise SaemError(f"{where}: impossible signature {sig}")
    return sig


def _jsonable(x, digits: int | None = None):
    """Plain JSON values; NaN/inf become null. Statistics are rounded, settings are not."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, digits) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist(), digits)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        if not math.isfinite(float(x)):
            return None
        return float(x) if digits is None else round(float(x), digits)
    return x


# --------------------------------------------------------------------------------------------


def _check_sequences(sequences: Sequence[SequenceTrace], n_expert: int) -> tuple[int, int]:
    if not sequences:
        raise SaemError("calibration needs at least one sequence")
    L = K = None
    for i, s in enumerate(sequences):
        ex = s.experts
        if not isinstance(ex, np.ndarray) or ex.ndim != 3:
            raise SaemError(f"sequence {i}: experts must be [T, L, K]")
        T = ex.shape[0]
        if len(s.pieces) != T or s.token_ids.shape[0] != T:
            raise SaemError(f"sequence {i}: {T} routed tokens but {len(s.pieces)} pieces / "
                            f"{s.token_ids.shape[0]} token ids")
        if L is None:
            L, K = ex.shape[1], ex.shape[2]
        elif ex.shape[1:] != (L, K):
            raise SaemError(f"sequence {i}: routing shape {ex.shape[1:]} differs from {(L, K)}")
        if T and (int(ex.max()) >= n_expert):
            raise SaemError(f"sequence {i}: expert id {int(ex.max())} >= n_expert {n_expert}")
        if not 0 <= s.prompt_len <= T:
            raise SaemError(f"sequence {i}: prompt_len {s.prompt_len} outside 0..{T}")
    return int(L), int(K)


def _segments(starts: list[int], begin: int, end: int) -> np.ndarray:
    """Stage bounds [S+1] from boundary tokens within (begin, end)."""
    inner = sorted({t for t in starts if begin < t < end})
    return np.asarray([begin, *inner, end], np.int64)


def calibrate(sequences: Sequence[SequenceTrace], n_expert: int, candidates: CueSet,
              cfg: CalibrationConfig | None = None, *, signature: ModelSignature | None = None,
              source: str = "") -> Profile:
    """Build the model-specific cue set Tmodel (and implicit thresholds) from routing traces.

    Only generated tokens (from each sequence's ``prompt_len``) are analysed. Every candidate's
    statistics and the reason it was kept or dropped are recorded in ``profile.stats``.
    """
    cfg = cfg or CalibrationConfig()
    cfg.validate()
    L, K = _check_sequences(sequences, n_expert)
    if signature is None:
        signature = ModelSignature(arch="unknown", n_layer=L, n_expert=n_expert, n_expert_used=K)
    elif (signature.n_layer, signature.n_expert, signature.n_expert_used) != (L, n_expert, K):
        raise SaemError(f"traces are [L={L}, E={n_expert}, K={K}] but the signature says "
                        f"[L={signature.n_layer}, E={signature.n_expert}, K={signature.n_expert_used}]")
    t0 = time.perf_counter()

    # All occurrences of every candidate (no minimum stage length: raw marker statistics).
    tables = compile_cues(candidates)
    matcher = CueMatcher(tables, 1, 0, start_is_boundary=False)
    occ: list[list[tuple[int, int]]] = []  # per sequence: (cue, token)
    n_gen = 0
    spans = []
    for s in sequences:
        ev = matcher.match_sequence(s.pieces[s.prompt_len:], start_token=s.prompt_len)
        occ.append(list(zip(ev.cue.tolist(), ev.token.tolist())))
        spans.append((s.prompt_len, s.n_tokens))
        n_gen += s.decoded_tokens
    n_seq = len(sequences)
    C = len(candidates)

    stats: dict[str, dict] = {}
    survivors: list[int] = []
    for c in range(C):
        per_seq = [[t for cc, t in o if cc == c] for o in occ]
        count = sum(len(x) for x in per_seq)
        seq_frac = sum(1 for x in per_seq if x) / n_seq
        rate = 1000.0 * count / max(n_gen, 1)
        lens = []
        for (b, e), toks in zip(spans, per_seq):
            if toks:
                lens.extend(np.diff(_segments(toks, b, e)).tolist())
        short = float(np.mean(np.asarray(lens) < cfg.min_stage_tokens)) if lens else 0.0
        st = {"text": candidates[c].text, "count": count, "seq_frac": seq_frac, "rate_per_1k": rate,
              "short_share": short, "tcseq": None, "kept": False, "reason": ""}
        if count < cfg.min_count or count == 0:
            st["reason"] = f"(a) rare: {count} occurrences < {cfg.min_count}"
        elif seq_frac < cfg.min_seq_frac:
            st["reason"] = f"(a) rare: in {seq_frac:.3f} of sequences < {cfg.min_seq_frac}"
        elif rate > cfg.max_rate_per_1k:
            st["reason"] = f"(a) too frequent: {rate:.2f} per 1k tokens > {cfg.max_rate_per_1k}"
        elif short > cfg.max_short_share:
            st["reason"] = (f"(b) noisy: {short:.3f} of its stages are shorter than {cfg.min_stage_tokens} "
                            f"tokens > {cfg.max_short_share}")
        else:
            survivors.append(c)
        stats[candidates[c].text] = st

    # (c) coherence of each surviving cue's transitions, in the segmentation they make together.
    cap = capacity_of(n_expert, cfg.capacity_ratio)
    per_cue_rows: dict[int, list[np.ndarray]] = {c: [] for c in survivors}
    per_cue_w: dict[int, list[float]] = {c: [] for c in survivors}
    shifts: dict[int, list[float]] = {c: [] for c in survivors}
    if survivors:
        _segment_by(sequences, occ, set(survivors), cfg.runtime_min_stage, n_expert, cap, per_cue_rows, per_cue_w,
                    shifts, cfg.shift_window)
    cue_tc = {}
    for c in survivors:
        res = _summarise(per_cue_rows[c], per_cue_w[c], L, cap, n_expert)
        cue_tc[c] = res.overall
        st = stats[candidates[c].text]
        st["tcseq"] = res.overall
        st["transitions"] = res.n_transitions
        st["shift"] = float(np.mean(shifts[c])) if shifts[c] else None
    finite = [v for v in cue_tc.values() if math.isfinite(v)]
    median_tc = float(np.median(finite)) if finite else float("nan")
    kept = []
    for c in survivors:
        tc = cue_tc[c]
        st = stats[candidates[c].text]
        if not math.isfinite(tc):
            st["reason"] = "(c) no transition survives the minimum stage length"
        elif tc < cfg.min_tcseq:
            st["reason"] = f"(c) incoherent: TCseq {tc:.3f} < {cfg.min_tcseq}"
        elif tc < cfg.min_tcseq_rel * median_tc:
            st["reason"] = f"(c) incoherent: TCseq {tc:.3f} < {cfg.min_tcseq_rel} x median {median_tc:.3f}"
        elif cfg.min_shift is not None and (st["shift"] is None or st["shift"] < cfg.min_shift):
            st["reason"] = f"(d) no routing change: shift {st['shift']} < {cfg.min_shift}"
        else:
            st["kept"] = True
            st["reason"] = "kept"
            kept.append(c)

    tmodel = CueSet(f"{signature.name or signature.arch}-calibrated", [candidates[c] for c in kept],
                    f"Tmodel calibrated from {n_seq} sequences ({source or 'traces'}) out of {candidates.name!r}")

    # The final segmentation: what the engine will see.
    final_rows: dict[int, list] = {c: [] for c in kept}
    final_w: dict[int, list] = {c: [] for c in kept}
    bounds_all = _segment_by(sequences, occ, set(kept), cfg.runtime_min_stage, n_expert, cap, final_rows, final_w)
    overall = _summarise([r for c in kept for r in final_rows[c]], [w for c in kept for w in final_w[c]], L, cap,
                         n_expert)
    lens = np.concatenate([np.diff(b) for b in bounds_all]) if bounds_all else np.empty(0)
    n_stages = np.asarray([len(b) - 1 for b in bounds_all])
    summary = {
        "n_sequences": n_seq,
        "n_generated_tokens": n_gen,
        "n_candidates": C,
        "n_kept": len(kept),
        "tcseq": overall.to_dict(),
        "stages_per_sequence": _describe(n_stages),
        "stage_tokens": _describe(lens),
        "short_stage_share": float(np.mean(lens < cfg.min_stage_tokens)) if lens.size else None,
        "median_cue_tcseq": median_tc,
    }
    truth = _truth_match(sequences, bounds_all, tol=cfg.min_stage_tokens)
    if truth is not None:
        summary["planted_boundaries"] = truth

    implicit = None
    if cfg.fit_implicit:
        implicit, imp_stats = _fit_implicit(sequences, bounds_all, n_expert, cfg)
        summary["implicit"] = imp_stats
    summary["seconds"] = time.perf_counter() - t0

    thresholds = {
        "min_stage_tokens": int(cfg.runtime_min_stage),
        "calibration": {k: v for k, v in asdict(cfg).items() if k != "implicit"},
    }
    return Profile(signature, tmodel, thresholds, implicit,
                   {"source": source, "summary": summary, "candidates": stats}, PROFILE_VERSION)


def calibrate_traceset(ts: TraceSet, candidates: CueSet, cfg: CalibrationConfig | None = None) -> Profile:
    return calibrate(ts.sequences, ts.signature.n_expert, candidates, cfg, signature=ts.signature, source=ts.source)


def _segment_by(sequences, occ, allowed: set[int], min_stage: int, n_expert: int, cap: int,
                rows: dict[int, list], wts: dict[int, list], shifts: dict[int, list] | None = None,
                shift_window: int = 64) -> list[np.ndarray]:
    """Boundaries made by the allowed cues (min stage length applied in stream order, the
    generation start counting as a boundary, like the runtime matcher), and each transition's
    per-layer TC attributed to the cue that made it. Returns the stage bounds per sequence."""
    out = []
    for s, o in zip(sequences, occ):
        begin, end = s.prompt_len, s.n_tokens
        last = begin
        bts, who = [], []
        for c, t in o:
            if c in allowed and t - last >= min_stage and begin < t < end:
                bts.append(t)
                who.append(c)
                last = t
        bounds = np.asarray([begin, *bts, end], np.int64)
        out.append(bounds)
        if not bts:
            continue
        hists = stage_histograms(s.experts, bounds, n_expert)
        for k, c in enumerate(who):
            nxt_len = int(bounds[k + 2] - bounds[k + 1])
            if nxt_len <= 0:
                continue
            rows[c].append(transition_coherence(hists[k], hists[k + 1], cap))
            wts[c].append(float(nxt_len))
            if shifts is not None:
                # Equal windows: [b-2m, b-m) -> [b-m, b) inside the stage vs [b-m, b) -> [b, b+m).
                b0, b1, b2 = int(bounds[k]), int(bounds[k + 1]), int(bounds[k + 2])
                m = min(shift_window, (b1 - b0) // 2, b2 - b1)
                if m >= 2:
                    h0 = stage_histogram(s.experts, n_expert, b1 - 2 * m, b1 - m)
                    h1 = stage_histogram(s.experts, n_expert, b1 - m, b1)
                    h2 = stage_histogram(s.experts, n_expert, b1, b1 + m)
                    within = np.nanmean(transition_coherence(h0, h1, cap))
                    across = np.nanmean(transition_coherence(h1, h2, cap))
                    shifts[c].append(float(within - across))
    return out


def _describe(x: np.ndarray) -> dict | None:
    if x.size == 0:
        return None
    return {"min": float(x.min()), "median": float(np.median(x)), "mean": float(x.mean()), "max": float(x.max()),
            "n": int(x.size)}


def _truth_match(sequences, bounds_all, tol: int) -> dict | None:
    """Recall/precision of the found boundaries against planted ones (synthetic traces)."""
    planted = found = hit_p = hit_f = 0
    for s, b in zip(sequences, bounds_all):
        truth = [int(x) for x in s.stage_starts[1:] if s.prompt_len < x < s.n_tokens]
        got = b[1:-1].tolist()
        planted += len(truth)
        found += len(got)
        hit_p += sum(1 for x in truth if any(0 <= g - x <= tol for g in got))
        hit_f += sum(1 for g in got if any(0 <= g - x <= tol for x in truth))
    if planted == 0:
        return None
    return {"planted": planted, "found": found, "recall": hit_p / planted,
            "precision": hit_f / found if found else None, "tolerance_tokens": tol}


def _fit_implicit(sequences, bounds_all, n_expert: int, cfg: CalibrationConfig) -> tuple[ImplicitConfig, dict]:
    """Thresholds from the excess statistic on within-stage routing (cue-bounded stages).

    Median and MAD rather than a high quantile: cue-less transitions inside the calibration
    stages produce a tail of large values that must not set the threshold."""
    base = cfg.implicit
    xs = []
    for s, b in zip(sequences, bounds_all):
        x = score_trace(s.experts[s.prompt_len:], n_expert, base, b[1:-1], start_token=s.prompt_len)
        xs.append(x[np.isfinite(x)])
    x = np.concatenate(xs) if xs else np.empty(0)
    if x.size < 100:
        return replace(base, min_stage_tokens=cfg.runtime_min_stage), {
            "fitted": False, "reason": f"only {x.size} within-stage scores", "n_scores": int(x.size)}
    med = float(np.median(x))
    sd = 1.4826 * float(np.median(np.abs(x - med)))
    high = max(base.high, med + cfg.implicit_z_high * sd)
    low = min(high, max(base.low, med + cfg.implicit_z_low * sd))
    fitted = replace(base, high=high, low=low, min_stage_tokens=cfg.runtime_min_stage)
    return fitted, {"fitted": True, "n_scores": int(x.size), "median": med, "robust_sd": sd, "high": high,
                    "low": low, "share_above_high": float(np.mean(x > high))}


__all__ = ["CalibrationConfig", "Profile", "calibrate", "calibrate_traceset", "PROFILE_VERSION", "TCSeq"]
