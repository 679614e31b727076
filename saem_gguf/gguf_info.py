"""What a GGUF holds, read with the `gguf` package (no llama.cpp load): the MoE shape and its bytes.

Every way a file can be wrong (missing, a directory, not GGUF, truncated, absurd metadata, and
everything llama.cpp would abort on: model_check) ends in GGUFFormatError with a one-line message;
nothing here lets a raw exception through.
"""

from __future__ import annotations

import mmap
import re
import struct
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from saem_gguf.errors import GGUFFormatError
from saem_gguf.model_check import check_model, check_split_part, check_structure, overridden_fields

GGUF_MAGIC = b"GGUF"
# Routed-expert tensors (and their per-expert biases/scales): llama.cpp's LLM_FFN_EXPS_REGEX.
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")
SHARED_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_\w+_shexp\.")
MAX_LAYERS = 4096
MAX_EXPERTS = 65536


@dataclass
class ExpertTensor:
    name: str
    kind: str  # gate | up | down | gate_up (and .bias/.scale aux tensors)
    type: str  # ggml type name, e.g. Q4_K
    shape: list[int]  # ggml order (ne0, ne1, ne2)
    nbytes: int


@dataclass
class MoELayer:
    index: int
    tensors: list[ExpertTensor] = field(default_factory=list)
    bytes_per_expert: int = 0  # gate + up + down (+ aux) of one expert


@dataclass
class ModelInfo:
    path: str
    file_bytes: int
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_ctx_train: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_ff_exp: int
    moe_layers: list[MoELayer]
    expert_bytes: int  # all routed experts, all layers
    non_expert_bytes: int  # everything else (attention, embeddings, router, shared experts)
    expert_types: list[str]
    # ggml types of the other 2-D weight matrices (attention, shared experts, dense FFNs, output;
    # not the token embedding, which llama.cpp only reads rows of)
    matrix_types: list[str] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0 and bool(self.moe_layers)

    @property
    def bytes_per_expert_all_layers(self) -> int:
        """Bytes that one cache slot in every MoE layer costs."""
        return sum(l.bytes_per_expert for l in self.moe_layers)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["is_moe"] = self.is_moe
        return d


def _check_header(path: Path) -> None:
    if not path.exists():
        raise GGUFFormatError(f"{path}: no such file")
    if path.is_dir():
        raise GGUFFormatError(f"{path}: is a directory, not a GGUF file")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise GGUFFormatError(f"{path}: cannot read ({e.strerror})") from None
    if head[:4] != GGUF_MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file (bad magic {head[:4]!r})")
    if len(head) < 24:
        raise GGUFFormatError(f"{path}: truncated GGUF ({size} bytes)")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: unsupported GGUF version {version}")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise GGUFFormatError(f"{path}: absurd header ({n_tensors} tensors, {n_kv} metadata keys)")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            check_structure(buf, n_tensors, n_kv)
    except GGUFFormatError as e:
        raise GGUFFormatError(f"{path}: {e}") from None
    except (OSError, ValueError) as e:
        raise GGUFFormatError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None


def _field(fields, key: str, default=None):
    f = fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - a malformed value is a format error, reported by caller
        raise GGUFFormatError(f"metadata key {key} is malformed") from None


def _int_field(fields, key: str, default: int, lo: int = 0, hi: int = 1 << 31) -> int:
    v = _field(fields, key, default)
    if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv): take the max
        v = max(v) if v else default
    try:
        v = int(v)
    except (TypeError, ValueError):
        raise GGUFFormatError(f"metadata {key}={v!r} is not an integer") from None
    if not lo <= v <= hi:
        raise GGUFFormatError(f"metadata {key}={v} is out of range [{lo}, {hi}]")
    return v


def read_model_info(path: str | Path, for_load: bool = False, overrides: tuple = ()) -> ModelInfo:
    """The file's MoE shape; ``for_load`` also requires every key a llama.cpp load needs;
    ``overrides`` (--override-kv, saem_gguf.kv_overrides) set metadata over the file's, checked as
    it is. A split model (``split.count`` > 1) is read whole, from its first part, as llama.cpp
    loads it: every part found by llama.cpp's names and checked."""
    path = Path(path)
    reader = _reader(path)
    try:
        _not_a_later_part(path, reader)
        check_model(reader, path.stat().st_size, for_load, overrides)
    except GGUFFormatError as e:
        raise GGUFFormatError(f"{path}: {e}") from None
    parts = [(path, reader)] + _other_parts(path, reader)
    try:
        return _info_from_readers(parts, overrides)
    except GGUFFormatError as e:
        raise GGUFFormatError(f"{path}: {e}") from None


def _reader(path: Path):
    """The gguf package's reader of ``path``, after gguf.cpp's structure checks."""
    _check_header(path)
    try:
        from gguf import GGUFReader

        # a corrupt offset or shape overflows the reader's NumPy arithmetic: that is reported
        # below (model_check redoes it in Python integers), not as a RuntimeWarning on stderr
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            return GGUFReader(path)
    except GGUFFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - the gguf reader raises many types on bad files
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GGUFFormatError(f"{path}: truncated or corrupt GGUF ({msg})") from None


def split_part_paths(path: Path, n_split: int) -> list[Path]:
    """The parts of a model split in ``n_split``, by llama.cpp's names (``llama_split_path``:
    PREFIX-00001-of-00003.gguf, ...), from its first part ``path``."""
    suffix = f"-00001-of-{n_split:05d}.gguf"
    if not path.name.endswith(suffix) or len(path.name) == len(suffix):
        raise GGUFFormatError(f"{path}: the first part of a model split in {n_split} must be named "
                              f"PREFIX{suffix} (llama.cpp finds the other parts by their names)")
    prefix = str(path)[:-len(suffix)]
    return [Path(f"{prefix}-{i:05d}-of-{n_split:05d}.gguf") for i in range(1, n_split + 1)]


def _not_a_later_part(path: Path, reader) -> None:
    """A split model's later part holds tensors but no model: it is loaded from the first part."""
    n_split = _int_field(reader.fields, "split.count", 0, 0, 65535)
    index = _int_field(reader.fields, "split.no", 0, 0, 65535)
    if n_split > 1 and index != 0:
        raise GGUFFormatError(f"part {index + 1} of a model split in {n_split}: give its first part "
                              f"(llama.cpp loads a split model from it)")


def _other_parts(path: Path, reader) -> list[tuple[Path, object]]:
    """The readers of a split model's parts after the first (none for a whole file), each checked
    as llama.cpp checks them; their tensors, and no more, as ``split.tensors.count`` says."""
    n_split = _int_field(reader.fields, "split.count", 0, 0, 65535)
    if n_split <= 1:
        return []
    parts = []
    for i, p in enumerate(split_part_paths(path, n_split)[1:], 1):
        if not p.exists():
            raise GGUFFormatError(f"{path}: part {i + 1} of this split model is missing: {p}")
        r = _reader(p)
        try:
            check_split_part(r, p.stat().st_size, i)
        except GGUFFormatError as e:
            raise GGUFFormatError(f"{p}: {e}") from None
        parts.append((p, r))
    names: set[str] = set()
    for p, r in [(path, reader)] + parts:
        for t in r.tensors:
            if t.name in names:
                raise GGUFFormatError(f"{p}: tensor {t.name} is in two parts of the split model")
            names.add(t.name)
    expected = _int_field(reader.fields, "split.tensors.count", len(names), 0, 1 << 31)
    if expected != len(names):
        raise GGUFFormatError(f"{path}: the split model's parts hold {len(names)} tensors, "
                              f"split.tensors.count says {expected}")
    return parts


def _info_from_readers(parts: list[tuple[Path, object]], overrides: tuple = ()) -> ModelInfo:
    path, reader = parts[0]
    fields = overridden_fields(reader.fields, overrides)
    arch = _field(fields, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFFormatError("no general.architecture: not a llama.cpp model file")
    a = arch
    n_layer = _int_field(fields, f"{a}.block_count", 0, 1, MAX_LAYERS)
    n_embd = _int_field(fields, f"{a}.embedding_length", 0, 1, 1 << 20)
    n_head = _int_field(fields, f"{a}.attention.head_count", 1, 0, 1 << 16)
    n_head_kv = _int_field(fields, f"{a}.attention.head_count_kv", n_head, 0, 1 << 16)
    hd = n_embd // max(n_head, 1)
    head_dim_k = _int_field(fields, f"{a}.attention.key_length", hd, 0, 1 << 16)
    head_dim_v = _int_field(fields, f"{a}.attention.value_length", hd, 0, 1 << 16)
    n_ctx_train = _int_field(fields, f"{a}.context_length", 0, 0, 1 << 31)
    n_expert = _int_field(fields, f"{a}.expert_count", 0, 0, MAX_EXPERTS)
    n_used = _int_field(fields, f"{a}.expert_used_count", 0, 0, MAX_EXPERTS)
    if n_expert and not (0 < n_used <= n_expert):
        raise GGUFFormatError(f"expert_used_count={n_used} must be in [1, expert_count={n_expert}]")
    n_shared = _int_field(fields, f"{a}.expert_shared_count", 0, 0, MAX_EXPERTS)
    n_ff_exp = _int_field(fields, f"{a}.expert_feed_forward_length", 0, 0, 1 << 24)
    tokens = fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else 0

    file_bytes = sum(p.stat().st_size for p, _ in parts)
    layers: dict[int, MoELayer] = {}
    expert_bytes = total_bytes = 0
    types: set[str] = set()
    matrix_types: set[str] = set()
    has_shexp = False
    # offsets, sizes and types: checked by check_model (check_split_part)
    for t in (t for _, r in parts for t in r.tensors):
        nbytes = int(t.n_bytes)
        total_bytes += nbytes
        if SHARED_EXPERT_TENSOR.match(t.name):
            has_shexp = True
        m = EXPERT_TENSOR.match(t.name)
        if not m:
            if len(t.shape) == 2 and t.name.endswith(".weight") and t.name != "token_embd.weight":
                matrix_types.add(t.tensor_type.name)
            continue
        il = int(m.group(1))
        if il >= n_layer:
            raise GGUFFormatError(f"tensor {t.name} names layer {il} but block_count={n_layer}")
        shape = [int(x) for x in t.shape]
        if len(shape) < 2 or n_expert == 0 or shape[-1] != n_expert:
            raise GGUFFormatError(f"tensor {t.name} shape {shape} does not hold expert_count="
                                  f"{n_expert} experts")
        tname = t.tensor_type.name
        kind = m.group(2) + ("" if t.name.endswith(".weight") else "." + t.name.rsplit(".", 1)[-1])
        layer = layers.setdefault(il, MoELayer(il))
        layer.tensors.append(ExpertTensor(t.name, kind, tname, shape, nbytes))
        layer.bytes_per_expert += nbytes // n_expert
        expert_bytes += nbytes
        if t.name.endswith(".weight"):
            types.add(tname)
            if m.group(2) in ("gate", "up", "gate_up") and not n_ff_exp:
                n_ff_exp = shape[1] // (2 if m.group(2) == "gate_up" else 1)
    if n_expert and has_shexp and not n_shared:
        n_shared = 1
    name = _field(fields, "general.name", "") or ""
    return ModelInfo(
        path=str(path), file_bytes=file_bytes, architecture=arch, name=str(name), n_layer=n_layer,
        n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_dim_k,
        head_dim_v=head_dim_v, n_vocab=n_vocab, n_ctx_train=n_ctx_train, n_expert=n_expert,
        n_expert_used=n_used, n_expert_shared=n_shared, n_ff_exp=n_ff_exp,
        moe_layers=[layers[k] for k in sorted(layers)], expert_bytes=expert_bytes,
        non_expert_bytes=total_bytes - expert_bytes, expert_types=sorted(types),
        matrix_types=sorted(matrix_types),
    )


def kv_cache_bytes(info: ModelInfo, n_ctx: int, bytes_per_elem: int = 2) -> int:
    """F16 K+V cache for n_ctx tokens (standard attention; MLA and hybrids are approximations)."""
    per_token = info.n_layer * info.n_head_kv * (info.head_dim_k + info.head_dim_v) * bytes_per_elem
    return int(per_token * n_ctx)


def compute_buffer_bytes(info: ModelInfo, n_ubatch: int = 512) -> int:
    """Estimate of llama.cpp's device compute buffer: logits plus a few activations per token."""
    width = max(info.n_embd, info.n_ff_exp * max(info.n_expert_used, 1))
    return int(n_ubatch * (info.n_vocab + 16 * width) * 4)
