"""Inputs for tests/test_bad_inputs.py: broken GGUFs, profiles, traces and prompt files, written
once per session from a small generated model and a synthetic trace."""

from __future__ import annotations

import base64
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from gguf_fuzz import mutation_slots
from saem_gguf.testmodels import ModelSpec, ensure_model

ARCH = "qwen3moe"
MODEL_SPEC = ModelSpec(arch=ARCH, expert_type="q4_0")
DENSE_SPEC = ModelSpec(arch="llama", expert_type="f16", dense=True)

U32, I32, F32, STR, ARR = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32,
                           GGUFValueType.STRING, GGUFValueType.ARRAY)


def rewrite_gguf(src: Path, dst: Path, changes: dict[str, tuple[GGUFValueType, object] | None],
                 array_sub: dict[str, GGUFValueType] | None = None, split_max_tensors: int = 0) -> Path:
    """A copy of ``src`` with metadata keys replaced (``(type, value)``) or removed (``None``);
    tensors copied as they are (``split_max_tensors``: into parts of that many, named as llama.cpp
    names a split model's parts, DST-00001-of-0000N.gguf, ...)."""
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch, split_max_tensors=split_max_tensors)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in changes:
            continue
        vtype = f.types[0]
        w.add_key_value(f.name, f.contents(), vtype, sub_type=f.types[-1] if vtype == ARR else None)
    for key, change in changes.items():
        if change is not None:
            vtype, value = change
            w.add_key_value(key, value, vtype, sub_type=(array_sub or {}).get(key))
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def patch_slot(src: Path, dst: Path, kind: str, name: str, value: int, index: int = 0) -> Path:
    """A copy of ``src`` with one tensor-info or header field (a fuzzer slot) set to ``value``."""
    slots = [s for s in mutation_slots(src) if s.kind == kind and s.name == name]
    s = slots[index]
    buf = bytearray(src.read_bytes())
    struct.pack_into(s.fmt, buf, s.offset, value)
    dst.write_bytes(bytes(buf))
    return dst


# name -> (metadata changes, the key the error must name)
K = f"{ARCH}."
BAD_METADATA: dict[str, tuple[dict, str]] = {
    "eps_nan": ({K + "attention.layer_norm_rms_epsilon": (F32, math.nan)}, "layer_norm_rms_epsilon"),
    "eps_negative": ({K + "attention.layer_norm_rms_epsilon": (F32, -1e-6)}, "layer_norm_rms_epsilon"),
    "eps_inf": ({K + "attention.layer_norm_rms_epsilon": (F32, math.inf)}, "layer_norm_rms_epsilon"),
    "eps_string": ({K + "attention.layer_norm_rms_epsilon": (STR, "1e-6")}, "layer_norm_rms_epsilon"),
    "block_count_string": ({K + "block_count": (STR, "2")}, "block_count"),
    "block_count_zero": ({K + "block_count": (U32, 0)}, "block_count"),
    "block_count_huge": ({K + "block_count": (U32, 513)}, "block_count"),
    "block_count_int32": ({K + "block_count": (I32, 2)}, "block_count"),
    "context_length_zero": ({K + "context_length": (U32, 0)}, "context_length"),
    "context_length_2p31": ({K + "context_length": (U32, 2**31)}, "context_length"),
    "context_length_max": ({K + "context_length": (U32, 2**32 - 1)}, "context_length"),
    "embedding_length_zero": ({K + "embedding_length": (U32, 0)}, "embedding_length"),
    "heads_zero": ({K + "attention.head_count": (U32, 0)}, "head_count"),
    "kv_heads_3_of_4": ({K + "attention.head_count_kv": (U32, 3)}, "head_count"),
    "kv_heads_zero": ({K + "attention.head_count_kv": (U32, 0)}, "head_count_kv"),
    "kv_heads_above_heads": ({K + "attention.head_count_kv": (U32, 8)}, "head_count_kv"),
    "kv_heads_float": ({K + "attention.head_count_kv": (F32, 2.0)}, "head_count_kv"),
    "key_length_zero": ({K + "attention.key_length": (U32, 0)}, "key_length"),
    "value_length_zero": ({K + "attention.value_length": (U32, 0)}, "value_length"),
    "rope_dims_odd": ({K + "rope.dimension_count": (U32, 15)}, "rope.dimension_count"),
    "rope_dims_above_head": ({K + "rope.dimension_count": (U32, 64)}, "rope.dimension_count"),
    "rope_scaling_bogus": ({K + "rope.scaling.type": (STR, "sideways")}, "rope.scaling.type"),
    "rope_base_nan": ({K + "rope.freq_base": (F32, math.nan)}, "rope.freq_base"),
    "rope_base_zero": ({K + "rope.freq_base": (F32, 0.0)}, "rope.freq_base"),
    "experts_too_many": ({K + "expert_count": (U32, 2000)}, "expert_count"),
    "experts_used_zero": ({K + "expert_used_count": (U32, 0)}, "expert_used_count"),
    "experts_used_above": ({K + "expert_used_count": (U32, 9)}, "expert_used_count"),
    "expert_count_string": ({K + "expert_count": (STR, "8")}, "expert_count"),
    "heads_per_layer_wrong_length": ({K + "attention.head_count": (ARR, [4, 4, 4])}, "head_count"),
    "tokens_not_strings": ({"tokenizer.ggml.tokens": (ARR, [1, 2, 3])}, "tokenizer.ggml.tokens"),
    "token_type_float": ({"tokenizer.ggml.token_type": (ARR, [1.0, 2.0])}, "token_type"),
    "merges_ints": ({"tokenizer.ggml.merges": (ARR, [1, 2])}, "merges"),
    "eos_id_string": ({"tokenizer.ggml.eos_token_id": (STR, "0")}, "eos_token_id"),
    "bos_id_int32": ({"tokenizer.ggml.bos_token_id": (I32, 1)}, "bos_token_id"),
}
# consistent metadata that contradicts the tensors: inspect accepts it, llama.cpp refuses it cleanly,
# and the error must quote llama.cpp's reason, not "failed to load model"
LOAD_MISMATCH: dict[str, tuple[dict, str]] = {
    "embedding_mismatch": ({K + "embedding_length": (U32, 128)}, "wrong shape"),
    "ff_exp_mismatch": ({K + "expert_feed_forward_length": (U32, 96)}, "wrong shape"),
}
ARRAY_SUBTYPES = {"tokenizer.ggml.tokens": U32, "tokenizer.ggml.token_type": F32,
                  "tokenizer.ggml.merges": U32, K + "attention.head_count": U32}
# tensor-info corruptions: name -> (slot kind, tensor, value, the words the error must hold)
BAD_TENSOR_INFO: dict[str, tuple[str, str, int, str]] = {
    "offset_wrapped": ("offset", "output_norm.weight", 2**64 - 1, "offset"),
    "offset_misplaced": ("offset", "output_norm.weight", 32, "offset"),
    "offset_past_end": ("offset", "output.weight", 1 << 40, "corrupt"),
    "dim_zero": ("dim", "token_embd.weight", 0, "shape"),
    "dim_huge": ("dim", "token_embd.weight", 2**63, "corrupt"),
    "n_dims_5": ("n_dims", "output_norm.weight", 5, "dimensions"),
    "type_unknown": ("tensor_type", "output_norm.weight", 99, "GGMLQuantizationType"),
    "type_rows_not_blocks": ("tensor_type", "output_norm.weight", int(gguf.GGMLQuantizationType.Q4_K), "block"),
}


@dataclass
class BadInputs:
    """Paths of everything the suite feeds the commands."""
    root: Path
    model: Path
    dense: Path
    gguf: dict[str, Path]
    profile: dict[str, Path]
    trace: dict[str, Path]
    prompts: dict[str, Path]


def make_bad_inputs(root: Path) -> BadInputs:
    root.mkdir(parents=True, exist_ok=True)
    model = ensure_model(MODEL_SPEC)
    dense = ensure_model(DENSE_SPEC)
    data = model.read_bytes()
    ggufs: dict[str, Path] = {}
    for name, (changes, _key) in BAD_METADATA.items():
        ggufs[name] = rewrite_gguf(model, root / f"{name}.gguf", changes, ARRAY_SUBTYPES)
    for name, (changes, _key) in LOAD_MISMATCH.items():
        ggufs[name] = rewrite_gguf(model, root / f"{name}.gguf", changes)
    for name, (kind, tensor, value, _words) in BAD_TENSOR_INFO.items():
        ggufs[name] = patch_slot(model, root / f"{name}.gguf", kind, tensor, value)
    ggufs["context_missing"] = rewrite_gguf(model, root / "context_missing.gguf",
                                            {K + "context_length": None})
    (root / "empty.gguf").write_bytes(b"")
    ggufs["empty"] = root / "empty.gguf"
    (root / "zip.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    ggufs["not_gguf"] = root / "zip.gguf"
    for frac in (0.001, 0.05, 0.5, 0.99):
        p = root / f"cut{frac}.gguf"
        p.write_bytes(data[: max(6, int(len(data) * frac))])
        ggufs[f"truncated_{frac}"] = p
    ggufs["version_1"] = patch_slot(model, root / "v1.gguf", "header", "version", 1)
    ggufs["version_99"] = patch_slot(model, root / "v99.gguf", "header", "version", 99)
    ggufs["n_tensors_huge"] = patch_slot(model, root / "nt.gguf", "header", "n_tensors", 2**40)
    ggufs["n_kv_huge"] = patch_slot(model, root / "nkv.gguf", "header", "n_kv", 2**62)
    return BadInputs(root, model, dense, ggufs, _profiles(root, model), _traces(root),
                     _prompt_files(root))


def _profiles(root: Path, model: Path) -> dict[str, Path]:
    from saem_gguf.gguf_info import read_model_info
    from saem_gguf.stage.calibrate import PROFILE_FORMAT, PROFILE_VERSION, encode_routing
    from saem_gguf.stage.cues import CueSet
    from saem_gguf.synthetic import SyntheticConfig, make_stage_traces

    info = read_model_info(model)
    L, E = len(info.moe_layers), info.n_expert
    base = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
            "signature": {"arch": ARCH, "n_layer": L, "n_expert": E,
                          "n_expert_used": info.n_expert_used},
            "cues": CueSet.load("general").to_dict(), "thresholds": {"min_stage_tokens": 8},
            "implicit": None, "stats": {}}
    variants = {
        "counts_string": {"stats": {"expert_counts": "many"}},
        "counts_ragged": {"stats": {"expert_counts": [[1] * E, [1] * (E - 1)]}},
        "counts_negative": {"stats": {"expert_counts": [[-1] * E] * L}},
        "counts_wrong_shape": {"stats": {"expert_counts": [[1] * E] * (L + 1)}},
        "counts_strings_inside": {"stats": {"expert_counts": [["1"] * E] * L}},
        "cue_profiles_list": {"stats": {"cue_profiles": [1, 2]}},
        "other_model": {"signature": {"arch": ARCH, "n_layer": L + 3, "n_expert": E,
                                      "n_expert_used": info.n_expert_used}},
        "wrong_format": {"format": "something-else"},
        "wrong_version": {"version": 999},
        "no_cues": {"cues": None},
        "thresholds_list": {"thresholds": [1]},
        "min_stage_negative": {"thresholds": {"min_stage_tokens": -3}},
        # the calibration sample the adaptive saem replays at load (stage.calibrate.encode_routing)
        "routing_number": {"stats": {"calibration_routing": 5}},
        "routing_not_base64": {"stats": {"calibration_routing": "not base64!"}},
        "routing_not_a_trace": {"stats": {"calibration_routing": base64.b64encode(b"hello").decode()}},
        "routing_other_model": {"stats": {"calibration_routing": encode_routing(make_stage_traces(
            SyntheticConfig(n_layer=L + 1, n_expert=E, top_k=info.n_expert_used, n_sequences=1,
                            stage_len_scale=0.05)))}},
    }
    out = {}
    for name, over in variants.items():
        d = {**base, **over}
        if over.get("cues", 1) is None:
            del d["cues"]
        p = root / f"profile-{name}.json"
        p.write_text(json.dumps(d))
        out[name] = p
    (root / "profile-not-json.json").write_text("{not json")
    out["not_json"] = root / "profile-not-json.json"
    (root / "profile-latin1.json").write_bytes(b'{"format": "\xe9"}')
    out["not_utf8"] = root / "profile-latin1.json"
    (root / "profile-array.json").write_text("[1, 2, 3]")
    out["array"] = root / "profile-array.json"
    return out


def _traces(root: Path) -> dict[str, Path]:
    from saem_gguf.synthetic import SyntheticConfig, make_stage_traces
    from saem_gguf.trace import TraceSet, save_traces

    ts = make_stage_traces(SyntheticConfig(n_sequences=2, seed=3))
    good = root / "good.npz"
    save_traces(ts, str(good))
    empty = root / "empty-trace.npz"
    save_traces(TraceSet(ts.signature, [], source="synthetic"), str(empty))
    (root / "not-a-trace.npz").write_bytes(b"hello, not a zip")
    data = good.read_bytes()
    (root / "cut-trace.npz").write_bytes(data[: len(data) // 2])
    import numpy as np

    np.savez(root / "other.npz", x=np.zeros(3))
    np.save(root / "array.npy", np.zeros(3))  # np.load reads it as a bare array, not an archive
    (root / "trace-dir.npz").mkdir()
    return {"good": good, "empty": empty, "not_npz": root / "not-a-trace.npz",
            "truncated": root / "cut-trace.npz", "foreign_npz": root / "other.npz", "npy": root / "array.npy",
            "directory": root / "trace-dir.npz"}


def _prompt_files(root: Path) -> dict[str, Path]:
    (root / "prompts-empty.txt").write_text("# only a comment\n\n")
    (root / "prompts-latin1.txt").write_bytes(b"caf\xe9 au lait?\n")
    return {"empty": root / "prompts-empty.txt", "not_utf8": root / "prompts-latin1.txt"}
