"""Reasoning-stage boundary detection: cue matching, implicit (routing) detection,
adjacent-stage coherence (TCseq) and offline calibration. See docs/STAGES.md."""

from saem_gguf.stage.calibrate import PROFILE_VERSION, CalibrationConfig, Profile, calibrate, calibrate_traceset
from saem_gguf.stage.coherence import (
    TCSeq,
    aggregate_stage,
    stage_frequencies,
    stage_histogram,
    stage_histograms,
    tcseq,
    top_experts,
    transition_coherence,
)
from saem_gguf.stage.cues import BOUNDARY_MODES, Cue, CueSet, builtin_cue_sets, load_cues
from saem_gguf.stage.detector import DetectorConfig, StageDetector, StageEvent
from saem_gguf.stage.implicit import ImplicitConfig, ImplicitDetector, ImplicitEvents, detect_trace, score_trace
from saem_gguf.stage.matcher import CueMatcher, MatchEvents, MatcherTables, compile_cues, find_cues

__all__ = [
    "BOUNDARY_MODES", "PROFILE_VERSION", "CalibrationConfig", "Cue", "CueMatcher", "CueSet", "DetectorConfig",
    "ImplicitConfig", "ImplicitDetector", "ImplicitEvents", "MatchEvents", "MatcherTables", "Profile", "StageDetector",
    "StageEvent", "TCSeq", "aggregate_stage", "builtin_cue_sets", "calibrate", "calibrate_traceset", "compile_cues",
    "detect_trace", "find_cues", "load_cues", "score_trace", "stage_frequencies", "stage_histogram",
    "stage_histograms", "tcseq", "top_experts", "transition_coherence",
]
