"""What llama.cpp asserts on, checked in a GGUF before llama.cpp sees it.

llama.cpp (the one llama-cpp-python 0.3.36 vendors) aborts the process (GGML_ASSERT -> SIGABRT)
on some bad values instead of returning an error: a NaN or negative norm epsilon, heads that do
not divide, zero head sizes, an unknown RoPE scaling type, more layers or experts than its fixed
arrays hold. Others it rejects with a generic "failed to load model" (wrong metadata types,
misplaced tensor data). ``check_model`` runs on the ``gguf`` package's reader of the file and turns
each into one GGUFFormatError that names the key or tensor. Sources of the rules, under
vendor/llama.cpp: ggml/src/gguf.cpp (tensor infos), src/llama-model.cpp (load_hparams),
src/llama-model-loader.cpp (key types, arrays), src/llama-vocab.cpp (tokenizer arrays),
src/llama-hparams.h (limits), ggml-cpu's rms_norm / rope (eps >= 0, even rope dims).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from saem_gguf.errors import GGUFFormatError

GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
# positions are int32 (llama_pos) and llama-cpp-python sizes arrays by the context
MAX_CONTEXT = 2**31 - 1
INT64_MAX = 2**63 - 1
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")

U32, I32, F32, BOOL, STR = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32,
                            GGUFValueType.BOOL, GGUFValueType.STRING)


@dataclass(frozen=True)
class KeyRule:
    """The GGUF type llama.cpp reads a key as (it throws on any other) and whether a per-layer
    array of that type is accepted instead (llama_model_loader::get_key_or_arr)."""
    type: GGUFValueType
    per_layer: bool = False


# "{arch}." keys llama.cpp's load_hparams reads for the architectures we support
ARCH_KEYS: dict[str, KeyRule] = {
    "context_length": KeyRule(U32), "embedding_length": KeyRule(U32), "block_count": KeyRule(U32),
    "feed_forward_length": KeyRule(U32, True), "expert_count": KeyRule(U32),
    "expert_used_count": KeyRule(U32, True), "expert_shared_count": KeyRule(U32),
    "expert_feed_forward_length": KeyRule(U32), "expert_shared_feed_forward_length": KeyRule(U32),
    "expert_group_count": KeyRule(U32), "expert_group_used_count": KeyRule(U32),
    "leading_dense_block_count": KeyRule(U32), "vocab_size": KeyRule(U32),
    "expert_weights_scale": KeyRule(F32), "expert_weights_norm": KeyRule(BOOL),
    "attention.head_count": KeyRule(U32, True), "attention.head_count_kv": KeyRule(U32, True),
    "attention.key_length": KeyRule(U32), "attention.value_length": KeyRule(U32),
    "attention.layer_norm_rms_epsilon": KeyRule(F32), "attention.layer_norm_epsilon": KeyRule(F32),
    "attention.q_lora_rank": KeyRule(U32), "attention.kv_lora_rank": KeyRule(U32),
    "attention.sliding_window": KeyRule(U32),
    "rope.dimension_count": KeyRule(U32), "rope.freq_base": KeyRule(F32),
    "rope.scaling.type": KeyRule(STR), "rope.scaling.factor": KeyRule(F32),
    "rope.scaling.original_context_length": KeyRule(U32),
}
GLOBAL_KEYS: dict[str, KeyRule] = {
    "general.architecture": KeyRule(STR), "general.alignment": KeyRule(U32),
    "tokenizer.ggml.model": KeyRule(STR), "tokenizer.ggml.pre": KeyRule(STR),
    "tokenizer.chat_template": KeyRule(STR),
    **{f"tokenizer.ggml.{k}_token_id": KeyRule(U32)
       for k in ("bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask")},
    "tokenizer.ggml.add_bos_token": KeyRule(BOOL), "tokenizer.ggml.add_eos_token": KeyRule(BOOL),
    # a split model's parts: llama.cpp reads split.no with gguf_get_val_u16, which aborts on others
    "split.no": KeyRule(GGUFValueType.UINT16), "split.count": KeyRule(GGUFValueType.UINT16),
}


def check_model(reader, file_bytes: int, for_load: bool = True, overrides: tuple = ()) -> None:
    """Raise GGUFFormatError (naming the key or tensor) on anything llama.cpp would abort on or
    reject in the file that ``reader`` (gguf.GGUFReader) holds, with ``overrides`` (--override-kv:
    (key, value) pairs) over its metadata as llama.cpp applies them. ``for_load=False`` (inspect)
    checks the values present but lets keys that only a load needs be missing."""
    fields = overridden_fields(reader.fields, overrides)
    arch_field = fields.get("general.architecture")
    arch = _scalar(arch_field) if arch_field is not None and _type_of(arch_field) == STR else None
    if not isinstance(arch, str) or not arch:
        raise GGUFFormatError("no general.architecture: not a llama.cpp model file")
    try:
        _check_key_types(fields, arch)
        _check_hparams(fields, arch, for_load)
        _check_vocab(fields)
    except GGUFFormatError as e:
        named = [k for k, _ in overrides if k in str(e)]
        raise GGUFFormatError(f"{e} (set by --override-kv {named[0]})" if named else str(e)) from None
    _check_tensor_infos(reader, file_bytes)


class OverrideField:
    """A scalar metadata value set by --override-kv, read as the gguf reader's fields are."""

    def __init__(self, gtype: GGUFValueType, value) -> None:
        self.types = [gtype]
        self.data = [0]
        self.parts = [np.array([value])] if gtype != STR else []
        self._value = value

    def contents(self):
        return self._value


# the GGUF types an override of each kind may set (llama.cpp: int64, double, bool, a string)
_OVERRIDE_SETS = {int: {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                        U32, I32, GGUFValueType.UINT64, GGUFValueType.INT64},
                  float: {F32, GGUFValueType.FLOAT64}, bool: {BOOL}, str: {STR}}
_OVERRIDE_NAMES = {int: "int", float: "float", bool: "bool", str: "str"}


def overridden_fields(fields, overrides: tuple) -> dict:
    """``fields`` (the reader's) with each (key, value) override in place, where llama.cpp would
    apply it: an override of a type llama.cpp does not read the key as, or of a per-layer key it
    only reads from the file (absent there, or an array), it ignores with a warning; that is a
    GGUFFormatError here, so that what is asked for is what runs."""
    if not overrides:
        return fields
    arch_field = fields.get("general.architecture")
    arch = _scalar(arch_field) if arch_field is not None and _type_of(arch_field) == STR else ""
    rules = {**GLOBAL_KEYS, **{f"{arch}.{k}": r for k, r in ARCH_KEYS.items()}}
    out = dict(fields)
    for key, value in overrides:
        kind = type(value)
        rule, present = rules.get(key), fields.get(key)
        want = rule.type if rule is not None else _type_of(present) if present is not None else None
        if want == GGUFValueType.ARRAY or (rule is not None and rule.per_layer and (
                present is None or _type_of(present) == GGUFValueType.ARRAY)):
            where = "absent from this file" if present is None else "an array in this file"
            raise GGUFFormatError(f"--override-kv {key}: {where}, which llama.cpp reads only from the file "
                                  f"(it would ignore the override)")
        if want is not None and want not in _OVERRIDE_SETS[kind]:
            fitting = next(n for t, n in _OVERRIDE_NAMES.items() if want in _OVERRIDE_SETS[t])
            raise GGUFFormatError(f"--override-kv {key}={_OVERRIDE_NAMES[kind]}:...: llama.cpp reads {key} as "
                                  f"{want.name.lower()}: give {fitting}:VALUE (it would ignore this one)")
        out[key] = OverrideField(want or next(iter(_OVERRIDE_SETS[kind])), value)
    return out


def check_split_part(reader, file_bytes: int, index: int) -> None:
    """Raise GGUFFormatError on anything llama.cpp would abort on or reject in part ``index`` (from
    0) of a split model: its ``split.no`` (read with gguf_get_val_u16, which aborts on another
    type) must say ``index``; its tensors are checked as a whole file's. Its other metadata is not
    read by llama.cpp (the first part's counts)."""
    fields = reader.fields
    f = fields.get("split.no")
    if f is None:
        raise GGUFFormatError("metadata split.no is missing: not a part of a split model")
    _check_key_types({"split.no": f}, "")
    if _scalar(f) != index:
        raise GGUFFormatError(f"it says it is part {_scalar(f) + 1} (split.no {_scalar(f)}), expected part {index + 1}")
    _check_tensor_infos(reader, file_bytes)


# --- file structure (gguf.cpp's reader, before the gguf package parses anything) ---------------
GGUF_MAX_STRING_LENGTH = 1 << 30
GGUF_MAX_ARRAY_ELEMENTS = 1 << 30
# bytes of one value of each scalar GGUFValueType (STRING: its length field; ARRAY: not scalar)
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 8: 8, 10: 8, 11: 8, 12: 8}


class _Cursor:
    """Reads little-endian fields of a GGUF with bounds checks: running past the end is an error."""

    def __init__(self, buf, pos: int) -> None:
        self.buf, self.pos, self.size = buf, pos, len(buf)

    def remaining(self) -> int:
        return self.size - self.pos

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if n > self.remaining():
            raise GGUFFormatError(f"truncated GGUF: the file ends inside {what}")
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0]

    def skip(self, n: int, what: str) -> None:
        if n > self.remaining():
            raise GGUFFormatError(f"{what} claims {n} bytes but only {self.remaining()} remain "
                                  "in the file: truncated, or a corrupt length")
        self.pos += n

    def string(self, what: str) -> bytes:
        n = self.unpack("<Q", what)
        if n > GGUF_MAX_STRING_LENGTH:
            raise GGUFFormatError(f"{what} has length {n} (corrupt length)")
        start = self.pos
        self.skip(n, what)
        return bytes(self.buf[start:self.pos])


def shown(name: str, limit: int = 64) -> str:
    """A key or tensor name as an error message shows it: a corrupt file's names can hold any
    bytes (newlines included) and be megabytes long."""
    if name.isprintable() and len(name) <= limit:
        return name
    return repr(name[:limit]) + ("..." if len(name) > limit else "")


def check_structure(buf, n_tensors: int, n_kv: int) -> None:
    """Walk the metadata and tensor infos of the GGUF in ``buf`` (bytes or mmap) as gguf.cpp does,
    checking every type id, string length and array length against the bytes that remain. The
    ``gguf`` package trusts these: a string key retyped as an array makes it build billions of
    array elements (tens of GB, minutes) before it notices the file is too short."""
    cur = _Cursor(buf, 24)
    for i in range(n_kv):
        key = shown(cur.string(f"metadata key #{i}").decode("utf-8", "replace"))
        vtype = cur.unpack("<I", f"the type of metadata {key}")
        count = 1
        if vtype == GGUFValueType.ARRAY:
            vtype = cur.unpack("<I", f"the element type of metadata {key}")
            count = cur.unpack("<Q", f"the length of metadata {key}")
            if count > GGUF_MAX_ARRAY_ELEMENTS:
                raise GGUFFormatError(f"metadata {key} claims {count} array elements (corrupt length)")
        if vtype not in _VALUE_BYTES:
            raise GGUFFormatError(f"metadata {key} has invalid GGUF type {vtype}")
        if vtype == GGUFValueType.STRING:
            if count * 8 > cur.remaining():
                raise GGUFFormatError(f"metadata {key} claims {count} strings but only "
                                      f"{cur.remaining()} bytes remain: truncated, or a corrupt length")
            for _ in range(count):
                cur.string(f"metadata {key}")
        else:
            cur.skip(count * _VALUE_BYTES[vtype], f"metadata {key}")
    for i in range(n_tensors):
        name = shown(cur.string(f"tensor name #{i}").decode("utf-8", "replace"))
        n_dims = cur.unpack("<I", f"the dimensions of tensor {name}")
        if n_dims > GGML_MAX_DIMS:
            raise GGUFFormatError(f"tensor {name} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
        cur.skip(8 * n_dims + 4 + 8, f"the shape, type and offset of tensor {name}")


# --- metadata --------------------------------------------------------------------------------
def _type_of(field) -> GGUFValueType:
    return field.types[0] if field.types else GGUFValueType.ARRAY


def _element_type(field) -> GGUFValueType | None:
    return field.types[-1] if len(field.types) > 1 else None


def _scalar(field):
    return field.parts[-1].tolist()[0] if _type_of(field) != STR else field.contents()


def _check_key_types(fields, arch: str) -> None:
    rules = {**GLOBAL_KEYS, **{f"{arch}.{k}": r for k, r in ARCH_KEYS.items()}}
    for key, rule in rules.items():
        f = fields.get(key)
        if f is None:
            continue
        t = _type_of(f)
        if t == rule.type:
            continue
        if rule.per_layer and t == GGUFValueType.ARRAY and _element_type(f) in (U32, I32):
            continue
        got = t.name.lower() + (f" of {_element_type(f).name.lower()}"
                                if t == GGUFValueType.ARRAY and _element_type(f) is not None else "")
        want = rule.type.name.lower() + (" or an array of it" if rule.per_layer else "")
        raise GGUFFormatError(f"metadata {shown(key)} is {got}, llama.cpp reads it as {want}")


def _values(fields, key: str) -> list | None:
    """A key's value(s) as a list of Python numbers (per-layer arrays as they are), or None."""
    f = fields.get(key)
    if f is None:
        return None
    if _type_of(f) == GGUFValueType.ARRAY:
        return [v for idx in f.data for v in f.parts[idx].tolist()]
    return [_scalar(f)]


def _one(fields, key: str, required: bool = False):
    v = _values(fields, key)
    if v is None:
        if required:
            raise GGUFFormatError(f"metadata {key} is missing (llama.cpp requires it)")
        return None
    return v[0]


def _in_range(key: str, v, lo, hi) -> None:
    if not lo <= v <= hi:
        raise GGUFFormatError(f"metadata {key}={v} is out of range [{lo}, {hi}]")


def _check_hparams(fields, arch: str, for_load: bool) -> None:
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    n_layer = _one(fields, k("block_count"), required=True)
    _in_range(k("block_count"), n_layer, 1, LLAMA_MAX_LAYERS)
    n_ctx_train = _one(fields, k("context_length"), required=for_load)
    if n_ctx_train is not None:
        _in_range(k("context_length"), n_ctx_train, 1, MAX_CONTEXT)
    n_embd = _one(fields, k("embedding_length"), required=True)
    _in_range(k("embedding_length"), n_embd, 1, 1 << 20)

    per_layer = {}
    for name in ("attention.head_count", "attention.head_count_kv", "feed_forward_length",
                 "expert_used_count"):
        vals = _values(fields, k(name))
        if vals is not None and len(vals) not in (1, n_layer):
            raise GGUFFormatError(f"metadata {k(name)} has {len(vals)} entries for block_count="
                                  f"{n_layer} layers")
        per_layer[name] = vals
    heads = per_layer["attention.head_count"] or ([0] if for_load else [1])
    heads_kv = per_layer["attention.head_count_kv"] or heads
    if max(heads) < 1:
        raise GGUFFormatError(f"metadata {k('attention.head_count')} is missing or 0 (attention "
                              "needs at least one head)")
    for il in range(n_layer):
        h = heads[il if len(heads) > 1 else 0]
        hkv = heads_kv[il if len(heads_kv) > 1 else 0]
        _in_range(k("attention.head_count"), h, 1, 1 << 16)
        _in_range(k("attention.head_count_kv"), hkv, 1, h)
        if h % hkv:
            raise GGUFFormatError(f"metadata {k('attention.head_count')}={h} is not a multiple of "
                                  f"{k('attention.head_count_kv')}={hkv} (llama.cpp aborts)")
    n_head = heads[0]
    head_k = _one(fields, k("attention.key_length"))
    head_v = _one(fields, k("attention.value_length"))
    if head_k is None or head_v is None:
        if n_embd % n_head:
            raise GGUFFormatError(f"metadata {k('embedding_length')}={n_embd} is not a multiple of "
                                  f"{k('attention.head_count')}={n_head} and no key/value length "
                                  "is given")
    head_k = n_embd // n_head if head_k is None else head_k
    head_v = n_embd // n_head if head_v is None else head_v
    _in_range(k("attention.key_length"), head_k, 1, 1 << 16)
    _in_range(k("attention.value_length"), head_v, 1, 1 << 16)
    n_rot = _one(fields, k("rope.dimension_count"))
    if n_rot is not None and not (n_rot % 2 == 0 and 0 <= n_rot <= head_k):
        raise GGUFFormatError(f"metadata {k('rope.dimension_count')}={n_rot} must be even and at most "
                              f"the key length {head_k}")

    n_expert = _one(fields, k("expert_count")) or 0
    _in_range(k("expert_count"), n_expert, 0, LLAMA_MAX_EXPERTS)
    used = per_layer["expert_used_count"] or [0]
    for u in used:
        if n_expert and not 0 < u <= n_expert:
            raise GGUFFormatError(f"metadata {k('expert_used_count')}={u} must be in [1, "
                                  f"expert_count={n_expert}]")
        if not n_expert and u:
            raise GGUFFormatError(f"metadata {k('expert_used_count')}={u} without experts "
                                  f"({k('expert_count')} is 0 or missing)")
    groups = _one(fields, k("expert_group_count")) or 0
    if groups and not (groups < n_expert and n_expert % groups == 0):
        raise GGUFFormatError(f"metadata {k('expert_group_count')}={groups} must divide and be less "
                              f"than expert_count={n_expert}")
    groups_used = _one(fields, k("expert_group_used_count")) or 0
    if groups > 1 and not 0 < groups_used < groups:
        raise GGUFFormatError(f"metadata {k('expert_group_used_count')}={groups_used} must be in "
                              f"[1, {groups - 1}]")
    if n_expert:
        ff_exp = _one(fields, k("expert_feed_forward_length"))
        if ff_exp is not None:
            _in_range(k("expert_feed_forward_length"), ff_exp, 1, 1 << 24)
    dense_lead = _one(fields, k("leading_dense_block_count"))
    if dense_lead is not None:
        _in_range(k("leading_dense_block_count"), dense_lead, 0, n_layer)

    for name in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
        eps = _one(fields, k(name))
        if eps is not None and not (math.isfinite(eps) and eps >= 0):
            raise GGUFFormatError(f"metadata {k(name)}={eps} must be finite and >= 0 (llama.cpp aborts)")
    base = _one(fields, k("rope.freq_base"))
    if base is not None and not (math.isfinite(base) and base > 0):
        raise GGUFFormatError(f"metadata {k('rope.freq_base')}={base} must be finite and > 0")
    factor = _one(fields, k("rope.scaling.factor"))
    if factor is not None and not (math.isfinite(factor) and factor >= 0):
        raise GGUFFormatError(f"metadata {k('rope.scaling.factor')}={factor} must be finite and >= 0")
    scaling = _one(fields, k("rope.scaling.type"))
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        raise GGUFFormatError(f"metadata {k('rope.scaling.type')}={scaling!r} is not one of "
                              f"{', '.join(ROPE_SCALING_TYPES)} (llama.cpp aborts)")


def _check_vocab(fields) -> None:
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return  # llama.cpp then loads no vocabulary (and says so)
    if _type_of(tokens) != GGUFValueType.ARRAY or _element_type(tokens) != STR:
        raise GGUFFormatError("metadata tokenizer.ggml.tokens must be an array of strings")
    n_vocab = len(tokens.data)
    _in_range("tokenizer.ggml.tokens (length)", n_vocab, 1, MAX_CONTEXT)
    for key, types in (("tokenizer.ggml.scores", (F32, I32)), ("tokenizer.ggml.token_type", (I32,))):
        f = fields.get(key)
        if f is None:
            continue
        if _type_of(f) != GGUFValueType.ARRAY or _element_type(f) not in types:
            raise GGUFFormatError(f"metadata {key} must be an array of "
                                  f"{' or '.join(t.name.lower() for t in types)}")
        if len(f.data) < n_vocab:
            raise GGUFFormatError(f"metadata {key} has {len(f.data)} entries for {n_vocab} tokens")
    merges = fields.get("tokenizer.ggml.merges")
    if merges is not None and (_type_of(merges) != GGUFValueType.ARRAY or _element_type(merges) != STR):
        raise GGUFFormatError("metadata tokenizer.ggml.merges must be an array of strings")


# --- tensor infos (gguf.cpp's gguf_init_from_file_impl, in Python integers: no wrap-around) ----
def _check_tensor_infos(reader, file_bytes: int) -> None:
    alignment = int(reader.alignment)
    expected_offset = 0
    data_start = int(reader.data_offset)
    for t in reader.tensors:
        _name_len, _name, n_dims_part, dims_part, type_part, offset_part = t.field.parts
        name = shown(t.name)
        if len(t.name.encode()) >= GGML_MAX_NAME:
            raise GGUFFormatError(f"tensor name {name} is longer than {GGML_MAX_NAME - 1} bytes")
        n_dims = int(n_dims_part[0])
        if n_dims > GGML_MAX_DIMS:
            raise GGUFFormatError(f"tensor {name} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
        dims = [int(x) for x in dims_part]
        if any(d < 1 or d > INT64_MAX for d in dims):
            raise GGUFFormatError(f"tensor {name} has an invalid shape {dims}")
        n_elements = math.prod(dims)
        if n_elements > INT64_MAX:
            raise GGUFFormatError(f"tensor {name} shape {dims} overflows 64-bit element counts")
        qtype = GGMLQuantizationType(int(type_part[0]))
        if qtype not in GGML_QUANT_SIZES:
            raise GGUFFormatError(f"tensor {name} has an unsupported type {qtype.name}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise GGUFFormatError(f"tensor {name} of type {qtype.name} has {dims[0]} elements per "
                                  f"row, not a multiple of its block size {block}")
        nbytes = n_elements // block * type_size
        offset = int(offset_part[0])
        if offset != expected_offset:
            raise GGUFFormatError(f"tensor {name} has data offset {offset}, expected "
                                  f"{expected_offset} (corrupt tensor info)")
        end = data_start + offset + nbytes
        if end > file_bytes:
            raise GGUFFormatError(f"tensor {name} ends at byte {end}, past the end of the file "
                                  f"({file_bytes} bytes): truncated")
        expected_offset += -(-nbytes // alignment) * alignment
