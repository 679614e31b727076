"""ctypes mirror of native/saem_native.h, one function per C function. Nothing else uses ctypes.

The functions live in the patched libllama itself; the handle is the one llama-cpp-python loaded
(``llama_cpp.llama_cpp._lib``), so there is exactly one copy of the library in the process.

Every function takes the same arguments as its C counterpart, except that array arguments are
Python sequences / returned lists (a NumPy array for the per-token routing read, the one hot
call) and the ``ctx`` argument may be a ``llama_context`` pointer (as
returned by ``llama_cpp.llama_init_from_model``) or a ``llama_cpp.Llama`` object. A negative C
status is raised as a :class:`NativeError` subclass carrying the C message; nothing returns codes.

See docs/NATIVE.md for the mechanism (expert slots, slot maps, copies, counters).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from saem_gguf.errors import BuildError, SaemError
from saem_gguf.llama_lib import load_llama_cpp

ABI_VERSION = 8  # SAEM_NATIVE_ABI_VERSION

# status codes (saem_native.h)
SAEM_OK = 0
SAEM_E_INVALID_ARG = -1
SAEM_E_LAYER = -2
SAEM_E_EXPERT = -3
SAEM_E_SLOT = -4
SAEM_E_NO_CACHE = -5
SAEM_E_NOT_MOE = -6
SAEM_E_UNSUPPORTED = -7
SAEM_E_NOT_HOST = -8
SAEM_E_MAP = -9
SAEM_E_ALLOC = -10
SAEM_E_BACKEND = -11
SAEM_E_INTERNAL = -12
SAEM_E_OS = -13

# counting modes
SAEM_COUNT_OFF = 0
SAEM_COUNT_ON = 1
SAEM_COUNT_IDS = 2

# saem_ram_prefetch(method)
SAEM_RAM_PREFETCH_MADVISE = 0
SAEM_RAM_PREFETCH_THREAD = 1

# saem_ram_release(advice) and its result
SAEM_RAM_RELEASE_AUTO = 0
SAEM_RAM_RELEASE_PAGEOUT = 1
SAEM_RAM_RELEASE_COLD = 2
SAEM_RAM_RELEASE_DONTNEED = 3

# saem_moe_get_counts(which)
COUNTS_LAST = 0
COUNTS_TOTAL = 1


class NativeError(SaemError):
    """A saem_moe_* call failed; ``code`` is the SAEM_E_* status, ``func`` the C function."""

    def __init__(self, code: int, func: str, message: str) -> None:
        super().__init__(message or f"{func} failed with status {code}")
        self.code = code
        self.func = func


class NativeArgumentError(NativeError, ValueError):
    """Bad argument: NULL/length/mode (SAEM_E_INVALID_ARG), layer/expert/slot out of range, bad map."""


class CacheNotInitialisedError(NativeError):
    """saem_moe_cache_init() has not been called on this context (SAEM_E_NO_CACHE)."""


class NotMoEError(NativeError):
    """The model, or this layer, has no experts (SAEM_E_NOT_MOE)."""


class UnsupportedModelError(NativeError):
    """Architecture or tensor layout the expert cache does not support (SAEM_E_UNSUPPORTED)."""


class NotHostMemoryError(NativeError):
    """Expert tensors are not in plain host memory: repacked or on a device (SAEM_E_NOT_HOST)."""


class DeviceMemoryError(NativeError, MemoryError):
    """The slots could not be allocated (SAEM_E_ALLOC)."""


class BackendError(NativeError):
    """Backend failure (SAEM_E_BACKEND) or an unexpected internal error (SAEM_E_INTERNAL)."""


class OsCallError(NativeError, OSError):
    """An OS call refused (mlock, madvise, mincore): SAEM_E_OS, errno's text in the message."""


_ERRORS: dict[int, type[NativeError]] = {
    SAEM_E_INVALID_ARG: NativeArgumentError,
    SAEM_E_LAYER: NativeArgumentError,
    SAEM_E_EXPERT: NativeArgumentError,
    SAEM_E_SLOT: NativeArgumentError,
    SAEM_E_MAP: NativeArgumentError,
    SAEM_E_NO_CACHE: CacheNotInitialisedError,
    SAEM_E_NOT_MOE: NotMoEError,
    SAEM_E_UNSUPPORTED: UnsupportedModelError,
    SAEM_E_NOT_HOST: NotHostMemoryError,
    SAEM_E_ALLOC: DeviceMemoryError,
    SAEM_E_BACKEND: BackendError,
    SAEM_E_INTERNAL: BackendError,
    SAEM_E_OS: OsCallError,
}


class saem_moe_layer_info(ctypes.Structure):
    """struct saem_moe_layer_info (saem_native.h)."""

    _fields_ = [
        ("il", ctypes.c_int32),
        ("n_expert", ctypes.c_int32),
        ("n_expert_used", ctypes.c_int32),
        ("n_slots", ctypes.c_int32),
        ("n_resident", ctypes.c_int32),
        ("n_mats", ctypes.c_int32),
        ("fused_gate_up", ctypes.c_int32),
        ("host_copyable", ctypes.c_int32),
        ("host_pinned", ctypes.c_int32),
        ("device_is_host", ctypes.c_int32),
        ("host_repacked", ctypes.c_int32),
        ("type", ctypes.c_int32 * 3),
        ("mat_nbytes", ctypes.c_uint64 * 3),
        ("expert_nbytes", ctypes.c_uint64),
        ("aux_nbytes", ctypes.c_uint64),
        ("device", ctypes.c_char * 64),
    ]


@dataclass(frozen=True)
class LayerInfo:
    """Python view of struct saem_moe_layer_info."""

    il: int
    n_expert: int
    n_expert_used: int
    n_slots: int
    n_resident: int
    n_mats: int
    fused_gate_up: bool
    host_copyable: bool
    host_pinned: bool
    device_is_host: bool
    repacked: tuple[bool, ...]  # per expert matrix: in ggml-cpu's repacked layout (CPU_REPACK)
    types: tuple[int, ...]  # ggml_type per expert matrix
    mat_nbytes: tuple[int, ...]  # bytes of one expert per matrix
    expert_nbytes: int  # bytes one copy moves
    aux_nbytes: int
    device: str


class llama_model_tensor_buft_override(ctypes.Structure):
    """struct llama_model_tensor_buft_override (llama.h); llama-cpp-python does not define it."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


_P_I16 = ctypes.POINTER(ctypes.c_int16)
_P_I32 = ctypes.POINTER(ctypes.c_int32)
_P_I64 = ctypes.POINTER(ctypes.c_int64)
_P_U64 = ctypes.POINTER(ctypes.c_uint64)
_CTX = ctypes.c_void_p

# name -> (argtypes, restype)
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "saem_native_version": ([], ctypes.c_char_p),
    "saem_native_abi_version": ([], ctypes.c_int32),
    "saem_last_error": ([], ctypes.c_char_p),
    "saem_expert_host_buft": ([ctypes.c_int32, _P_I32], ctypes.c_void_p),
    "saem_cpu_amx_tiles_fault": ([], ctypes.c_int32),
    "saem_expert_tensor_regex": ([], ctypes.c_char_p),
    "saem_moe_n_layers": ([_CTX], ctypes.c_int32),
    "saem_moe_get_layer_info": ([_CTX, ctypes.c_int32, ctypes.POINTER(saem_moe_layer_info)], ctypes.c_int32),
    "saem_moe_cache_init": ([_CTX, _P_I32, ctypes.c_int32], ctypes.c_int32),
    "saem_moe_cache_is_init": ([_CTX], ctypes.c_int32),
    "saem_moe_set_slot_map": ([_CTX, ctypes.c_int32, _P_I32, ctypes.c_int32], ctypes.c_int32),
    "saem_moe_get_slot_map": ([_CTX, ctypes.c_int32, _P_I32, ctypes.c_int32], ctypes.c_int32),
    "saem_moe_get_slot_owner": ([_CTX, ctypes.c_int32, _P_I32, ctypes.c_int32], ctypes.c_int32),
    "saem_moe_copy_expert": ([_CTX, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
    "saem_moe_copy_expert_async": ([_CTX, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32],
                                   ctypes.c_int32),
    "saem_moe_copy_experts_async": ([_CTX, _P_I32, ctypes.c_int32], ctypes.c_int32),
    "saem_moe_set_slot_maps": ([_CTX, _P_I32, _P_I32, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
    "saem_moe_copy_query": ([_CTX], ctypes.c_int32),
    "saem_moe_copy_sync": ([_CTX], ctypes.c_int32),
    "saem_moe_set_counting": ([_CTX, ctypes.c_int32], ctypes.c_int32),
    "saem_moe_get_counting": ([_CTX], ctypes.c_int32),
    "saem_moe_get_counts": ([_CTX, ctypes.c_int32, ctypes.c_int32, _P_I64, ctypes.c_int32], ctypes.c_int32),
    "saem_moe_reset_counts": ([_CTX], ctypes.c_int32),
    "saem_moe_counted_tokens": ([_CTX], ctypes.c_int64),
    "saem_moe_get_last_ids": ([_CTX, ctypes.c_int32, _P_I32, ctypes.c_int32, _P_I32, _P_I32], ctypes.c_int32),
    "saem_moe_get_last_routing": ([_CTX, _P_I16, ctypes.c_int32, _P_I32, _P_I32, _P_I32, _P_I64], ctypes.c_int32),
    "saem_moe_routing_sink": ([_CTX, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)],
                              ctypes.c_int32),
    "saem_moe_set_stock_min_batch": ([_CTX, ctypes.c_int32], ctypes.c_int32),
    "saem_moe_get_stock_min_batch": ([_CTX], ctypes.c_int32),
    "saem_ram_experts_mapped": ([_CTX], ctypes.c_int32),
    "saem_ram_expert_ranges": ([_CTX, ctypes.c_int32, ctypes.c_int32, _P_U64, _P_U64, ctypes.c_int32],
                               ctypes.c_int32),
    "saem_ram_prefetch": ([_CTX, ctypes.c_int32, _P_I32, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
    "saem_ram_set_route_prefetch": ([_CTX, ctypes.c_int32], ctypes.c_int32),
    "saem_ram_route_prefetched": ([_CTX], ctypes.c_int64),
    "saem_ram_prefetch_wait": ([_CTX], ctypes.c_int32),
    "saem_ram_release": ([_CTX, ctypes.c_int32, _P_I32, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32),
    "saem_ram_expert_residency": ([_CTX, ctypes.c_int32, ctypes.c_int32, _P_U64, _P_U64], ctypes.c_int32),
    "saem_ram_lock_non_expert": ([_CTX, _P_U64], ctypes.c_int32),
    "saem_ram_unlock_non_expert": ([_CTX], ctypes.c_int32),
}

_bound: dict[str, Callable[..., Any]] = {}


def _lib() -> ctypes.CDLL:
    lib = load_llama_cpp().llama_cpp._lib
    if not hasattr(lib, "saem_native_version"):
        raise BuildError("the loaded libllama has no saem_native_version: it is not the patched build")
    return lib


def _fn(name: str) -> Callable[..., Any]:
    f = _bound.get(name)
    if f is None:
        lib = _lib()
        try:
            f = getattr(lib, name)
        except AttributeError as e:
            raise BuildError(f"the loaded libllama lacks {name}: rebuild (`python -m saem_gguf build`)") from e
        f.argtypes, f.restype = _SIGNATURES[name]
        _bound[name] = f
    return f


def _check(name: str, rc: int) -> int:
    if rc < 0:
        msg = _fn("saem_last_error")()
        raise _ERRORS.get(rc, BackendError)(int(rc), name, msg.decode(errors="replace") if msg else "")
    return int(rc)


def _ctx(ctx: Any) -> ctypes.c_void_p:
    """A llama_context pointer from a pointer, an int or a llama_cpp.Llama."""
    inner = getattr(ctx, "_ctx", None)  # llama_cpp.Llama -> LlamaContext
    if inner is not None:
        ctx = inner.ctx
    if ctx is None:
        raise NativeArgumentError(SAEM_E_INVALID_ARG, "ctx", "ctx is None (closed Llama?)")
    if isinstance(ctx, int):
        return ctypes.c_void_p(ctx)
    return ctypes.cast(ctx, ctypes.c_void_p)


class _Int32Buffer:
    """An int32 NumPy array's memory as a ``const int32_t *`` argument (ctypes passes
    ``_as_parameter_``), kept alive by holding the array; ``len`` is its length."""

    __slots__ = ("array", "_as_parameter_")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._as_parameter_ = array.ctypes.data_as(_P_I32)

    def __len__(self) -> int:
        return self.array.shape[0]


def _i32_array(values: Sequence[int] | np.ndarray, what: str) -> ctypes.Array | _Int32Buffer:
    """``values`` as a C int32 array argument. A contiguous 1-D int32 NumPy array is passed as
    its own memory: building a ctypes array from a list is 20 us for 128 entries, and the engine
    sets slot maps from its int32 rows, up to one per layer in a token that changes residency."""
    if isinstance(values, np.ndarray) and values.dtype == np.int32 and values.ndim == 1 \
            and values.flags.c_contiguous:
        return _Int32Buffer(values)
    if isinstance(values, np.ndarray):
        values = values.tolist()
    try:
        return (ctypes.c_int32 * len(values))(*[int(v) for v in values])
    except (TypeError, ValueError, OverflowError) as e:
        raise NativeArgumentError(SAEM_E_INVALID_ARG, what, f"{what}: {e}") from e


def _i32_rows(values: Sequence[Sequence[int]] | np.ndarray, width: int | None, what: str) -> np.ndarray:
    """``values`` as a C-contiguous int32 array [n, width] (``width`` None: any, n >= 0 rows of
    one width). A C-contiguous int32 array of that shape, what the engine passes, is used as it
    is, with no NumPy call: after a decode has emptied the caches each one costs microseconds."""
    if type(values) is np.ndarray and values.dtype == np.int32 and values.ndim == 2 \
            and values.flags.c_contiguous and (width is None or values.shape[1] == width):
        return values
    try:
        arr = np.ascontiguousarray(values, np.int32)
    except (TypeError, ValueError, OverflowError) as e:
        raise NativeArgumentError(SAEM_E_INVALID_ARG, what, f"{what}: {e}") from e
    if arr.size == 0:
        arr = arr.reshape(0, width or 0)
    if arr.ndim != 2 or (width is not None and arr.shape[1] != width):
        shape = "n x " + str(width) if width is not None else "2-D"
        raise NativeArgumentError(SAEM_E_INVALID_ARG, what, f"{what}: shape {arr.shape}, expected {shape}")
    return arr


def _call(name: str, *args: Any) -> int:
    return _check(name, _fn(name)(*args))


# ---------------------------------------------------------------------------------------------
# version


def saem_native_version() -> str:
    """const char * saem_native_version(void);"""
    return _fn("saem_native_version")().decode()


def saem_native_abi_version() -> int:
    """int32_t saem_native_abi_version(void);"""
    return int(_fn("saem_native_abi_version")())


def saem_last_error() -> str:
    """const char * saem_last_error(void);  -- message of the last failing call on this thread."""
    msg = _fn("saem_last_error")()
    return msg.decode(errors="replace") if msg else ""


# ---------------------------------------------------------------------------------------------
# model loading helpers


def saem_expert_host_buft(want_pinned: bool) -> tuple[int, bool]:
    """void * saem_expert_host_buft(int32_t want_pinned, int32_t * is_pinned);

    Returns (buffer type pointer, is_pinned)."""
    pinned = ctypes.c_int32(0)
    p = _fn("saem_expert_host_buft")(1 if want_pinned else 0, ctypes.byref(pinned))
    return int(p), bool(pinned.value)


def saem_cpu_amx_tiles_fault() -> bool:
    """int32_t saem_cpu_amx_tiles_fault(void);  -- the build has AMX kernels, the tiles fault here."""
    return bool(_fn("saem_cpu_amx_tiles_fault")())


def saem_expert_tensor_regex() -> str:
    """const char * saem_expert_tensor_regex(void);"""
    return _fn("saem_expert_tensor_regex")().decode()


def keep_experts_on_host(model_params: Any, *, pinned: bool = True) -> Any:
    """Set ``model_params`` (a ``llama_cpp.llama_model_params``) so every expert tensor stays in host
    memory the cache can copy from: a tensor-buffer override to :func:`saem_expert_host_buft`
    (pinned host memory of the first GPU when ``pinned`` and a GPU exists, else the plain CPU
    buffer, never repacked: repacked experts cannot be copied) and, for pinned memory,
    ``load_mode = LLAMA_LOAD_MODE_NONE`` (mmap would bypass the pinned buffer). Every other weight
    loads as stock llama.cpp loads it, extra buffer types (repacking, AMX) included unless the
    caller turned them off (``use_extra_bufts``, llama.cpp's ``--no-repack``).

    Returns the override array: keep it alive until the model is loaded."""
    buft, is_pinned = saem_expert_host_buft(pinned)
    arr = (llama_model_tensor_buft_override * 2)()
    arr[0].pattern = saem_expert_tensor_regex().encode()
    arr[0].buft = buft
    arr[1].pattern = None
    arr[1].buft = None
    model_params.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
    if is_pinned:
        model_params.load_mode = 0  # LLAMA_LOAD_MODE_NONE
    return arr


# ---------------------------------------------------------------------------------------------
# layers and cache


def saem_moe_n_layers(ctx: Any) -> int:
    """int32_t saem_moe_n_layers(const struct llama_context * ctx);"""
    return _call("saem_moe_n_layers", _ctx(ctx))


def saem_moe_get_layer_info(ctx: Any, il: int) -> LayerInfo:
    """int32_t saem_moe_get_layer_info(const struct llama_context * ctx, int32_t il,
    struct saem_moe_layer_info * out);"""
    out = saem_moe_layer_info()
    _call("saem_moe_get_layer_info", _ctx(ctx), int(il), ctypes.byref(out))
    n = out.n_mats
    return LayerInfo(
        il=out.il, n_expert=out.n_expert, n_expert_used=out.n_expert_used, n_slots=out.n_slots,
        n_resident=out.n_resident, n_mats=n, fused_gate_up=bool(out.fused_gate_up),
        host_copyable=bool(out.host_copyable), host_pinned=bool(out.host_pinned),
        device_is_host=bool(out.device_is_host),
        repacked=tuple(bool(out.host_repacked >> k & 1) for k in range(n)), types=tuple(out.type[:n]),
        mat_nbytes=tuple(int(x) for x in out.mat_nbytes[:n]), expert_nbytes=int(out.expert_nbytes),
        aux_nbytes=int(out.aux_nbytes), device=out.device.decode(errors="replace"))


def saem_moe_cache_init(ctx: Any, n_slots: Sequence[int]) -> None:
    """int32_t saem_moe_cache_init(struct llama_context * ctx, const int32_t * n_slots, int32_t n_layers);

    ``n_slots`` has one entry per layer (0 allowed; all zero frees the cache)."""
    arr = _i32_array(n_slots, "n_slots")
    _call("saem_moe_cache_init", _ctx(ctx), arr, len(arr))


def saem_moe_cache_is_init(ctx: Any) -> bool:
    """int32_t saem_moe_cache_is_init(const struct llama_context * ctx);"""
    return bool(_call("saem_moe_cache_is_init", _ctx(ctx)))


def saem_moe_set_slot_map(ctx: Any, il: int, expert_to_slot: Sequence[int]) -> None:
    """int32_t saem_moe_set_slot_map(struct llama_context * ctx, int32_t il,
    const int32_t * expert_to_slot, int32_t n_expert);   -- -1 = compute on the host"""
    arr = _i32_array(expert_to_slot, "expert_to_slot")
    _call("saem_moe_set_slot_map", _ctx(ctx), int(il), arr, len(arr))


def saem_moe_get_slot_map(ctx: Any, il: int) -> list[int]:
    """int32_t saem_moe_get_slot_map(const struct llama_context * ctx, int32_t il,
    int32_t * expert_to_slot, int32_t n_expert);"""
    n = saem_moe_get_layer_info(ctx, il).n_expert
    arr = (ctypes.c_int32 * max(n, 1))()
    _call("saem_moe_get_slot_map", _ctx(ctx), int(il), arr, n)
    return list(arr[:n])


def saem_moe_get_slot_owner(ctx: Any, il: int) -> list[int]:
    """int32_t saem_moe_get_slot_owner(const struct llama_context * ctx, int32_t il,
    int32_t * slot_to_expert, int32_t n_slots);   -- -1 = empty slot"""
    n = saem_moe_get_layer_info(ctx, il).n_slots
    arr = (ctypes.c_int32 * max(n, 1))()
    _call("saem_moe_get_slot_owner", _ctx(ctx), int(il), arr, n)
    return list(arr[:n])


def saem_moe_copy_expert(ctx: Any, il: int, expert: int, slot: int, update_map: bool = True) -> None:
    """int32_t saem_moe_copy_expert(struct llama_context * ctx, int32_t il, int32_t expert,
    int32_t slot, int32_t update_map);   -- synchronous"""
    _call("saem_moe_copy_expert", _ctx(ctx), int(il), int(expert), int(slot), 1 if update_map else 0)


def saem_moe_copy_expert_async(ctx: Any, il: int, expert: int, slot: int, update_map: bool = True) -> None:
    """int32_t saem_moe_copy_expert_async(struct llama_context * ctx, int32_t il, int32_t expert,
    int32_t slot, int32_t update_map);   -- copy stream + event; the next decode waits on the device"""
    _call("saem_moe_copy_expert_async", _ctx(ctx), int(il), int(expert), int(slot), 1 if update_map else 0)


def saem_moe_copy_experts_async(ctx: Any, copies: Sequence[Sequence[int]] | np.ndarray) -> None:
    """int32_t saem_moe_copy_experts_async(struct llama_context * ctx, const int32_t * copies,
    int32_t n);   -- ``copies`` [n, 3]: (il, expert, slot) rows, in order; all checked first"""
    arr = _i32_rows(copies, 3, "copies")
    _call("saem_moe_copy_experts_async", _ctx(ctx), arr.ctypes.data_as(_P_I32), arr.shape[0])


def saem_moe_set_slot_maps(ctx: Any, layers: Sequence[int] | np.ndarray,
                           expert_to_slot: Sequence[Sequence[int]] | np.ndarray) -> None:
    """int32_t saem_moe_set_slot_maps(struct llama_context * ctx, const int32_t * layers,
    const int32_t * expert_to_slot, int32_t n, int32_t n_expert);   -- ``expert_to_slot`` [n,
    n_expert]: row i is layer ``layers[i]``'s map; all checked first"""
    ils = _i32_array(layers, "layers")
    maps = _i32_rows(expert_to_slot, None, "expert_to_slot")
    if maps.shape[0] != len(ils):
        raise NativeArgumentError(SAEM_E_INVALID_ARG, "expert_to_slot",
                                  f"expert_to_slot has {maps.shape[0]} rows for {len(ils)} layers")
    _call("saem_moe_set_slot_maps", _ctx(ctx), ils, maps.ctypes.data_as(_P_I32), len(ils), maps.shape[1])


def saem_moe_copy_query(ctx: Any) -> bool:
    """int32_t saem_moe_copy_query(struct llama_context * ctx);   -- True when all copies are done"""
    return bool(_call("saem_moe_copy_query", _ctx(ctx)))


def saem_moe_copy_sync(ctx: Any) -> None:
    """int32_t saem_moe_copy_sync(struct llama_context * ctx);   -- block until all copies are done"""
    _call("saem_moe_copy_sync", _ctx(ctx))


# ---------------------------------------------------------------------------------------------
# routing counters


def saem_moe_set_counting(ctx: Any, mode: int) -> None:
    """int32_t saem_moe_set_counting(struct llama_context * ctx, int32_t mode);
    -- SAEM_COUNT_OFF / SAEM_COUNT_ON / SAEM_COUNT_IDS"""
    _call("saem_moe_set_counting", _ctx(ctx), int(mode))


def saem_moe_get_counting(ctx: Any) -> int:
    """int32_t saem_moe_get_counting(const struct llama_context * ctx);"""
    return _call("saem_moe_get_counting", _ctx(ctx))


def saem_moe_get_counts(ctx: Any, il: int, which: int = COUNTS_TOTAL) -> list[int]:
    """int32_t saem_moe_get_counts(const struct llama_context * ctx, int32_t il, int32_t which,
    int64_t * counts, int32_t n_expert);   -- which: COUNTS_LAST (0) or COUNTS_TOTAL (1)"""
    n = saem_moe_get_layer_info(ctx, il).n_expert
    arr = (ctypes.c_int64 * max(n, 1))()
    _call("saem_moe_get_counts", _ctx(ctx), int(il), int(which), arr, n)
    return list(arr[:n])


def saem_moe_reset_counts(ctx: Any) -> None:
    """int32_t saem_moe_reset_counts(struct llama_context * ctx);"""
    _call("saem_moe_reset_counts", _ctx(ctx))


def saem_moe_counted_tokens(ctx: Any) -> int:
    """int64_t saem_moe_counted_tokens(const struct llama_context * ctx);"""
    return _call("saem_moe_counted_tokens", _ctx(ctx))


def saem_moe_get_last_ids(ctx: Any, il: int) -> list[list[int]]:
    """int32_t saem_moe_get_last_ids(const struct llama_context * ctx, int32_t il, int32_t * ids,
    int32_t cap, int32_t * n_tokens, int32_t * n_used);

    Returns the top-k expert ids of the last ubatch, one list of n_expert_used ids per token."""
    c = _ctx(ctx)
    nt, nu = ctypes.c_int32(0), ctypes.c_int32(0)
    n = _call("saem_moe_get_last_ids", c, int(il), None, 0, ctypes.byref(nt), ctypes.byref(nu))
    arr = (ctypes.c_int32 * max(n, 1))()
    _call("saem_moe_get_last_ids", c, int(il), arr, n, ctypes.byref(nt), ctypes.byref(nu))
    k = nu.value
    return [list(arr[t * k:(t + 1) * k]) for t in range(nt.value)]


def saem_moe_get_last_routing(ctx: Any, cap: int = 0) -> np.ndarray:
    """int32_t saem_moe_get_last_routing(const struct llama_context * ctx, int16_t * out,
    int32_t cap, int32_t * n_tokens, int32_t * n_layers, int32_t * n_used, int64_t * n_slot_uses);

    Returns the last ubatch's top-k expert ids of every MoE layer as a new int16 array
    [n_tokens, n_moe_layers, n_used] (-1 where a layer computed fewer tokens). ``cap`` is a size
    guess (entries): when it is large enough this is one C call, otherwise a second one fetches
    the ids into a buffer of the size the first reported. ``n_slot_uses`` is not asked for here
    (:class:`LastRoutingReader` reads it from the routing sink)."""
    c = _ctx(ctx)
    nt, nl, nu = ctypes.c_int32(0), ctypes.c_int32(0), ctypes.c_int32(0)
    buf = np.empty(max(int(cap), 0), np.int16)
    ptr = buf.ctypes.data_as(_P_I16) if buf.size else None
    need = _call("saem_moe_get_last_routing", c, ptr, buf.size, ctypes.byref(nt), ctypes.byref(nl),
                 ctypes.byref(nu), None)
    if need > buf.size:
        buf = np.empty(need, np.int16)
        _call("saem_moe_get_last_routing", c, buf.ctypes.data_as(_P_I16), need, ctypes.byref(nt),
              ctypes.byref(nl), ctypes.byref(nu), None)
    return buf[:need].reshape(nt.value, nl.value, nu.value)


# the routing sink's header fields (SAEM_SINK_*)
SAEM_SINK_SERIAL = 0
SAEM_SINK_NEED = 1
SAEM_SINK_N_TOKENS = 2
SAEM_SINK_N_LAYERS = 3
SAEM_SINK_N_USED = 4
SAEM_SINK_N_SLOT_USES = 5
SAEM_SINK_HEADER = 6


def saem_moe_routing_sink(ctx: Any, cap: int) -> tuple[int, int, int]:
    """int32_t saem_moe_routing_sink(struct llama_context * ctx, int32_t cap, int64_t ** header,
    int16_t ** ids);

    Returns (capacity, header address, ids address): the native buffer into which every compute
    writes the last ubatch's routing (int64 header[SAEM_SINK_HEADER], int16 ids[capacity]); (0, 0,
    0) for cap 0, which turns it off. :class:`LastRoutingReader` reads it."""
    header, ids = ctypes.c_void_p(), ctypes.c_void_p()
    n = _call("saem_moe_routing_sink", _ctx(ctx), int(cap), ctypes.byref(header), ctypes.byref(ids))
    return n, header.value or 0, ids.value or 0


class LastRoutingReader:
    """The last ubatch's routing of one context, at the rate of one read per decoded token.

    It reads the native routing sink (``saem_moe_routing_sink``), which every decode fills, so a
    read makes no native call: after a decode has emptied the caches a ctypes call costs tens of
    microseconds (docs/POLICIES_HISTORY.md, per-token cost), reading memory next to nothing. A ubatch whose
    routing exceeds ``cap`` entries is read with ``saem_moe_get_last_routing``. One reader per
    context: a later sink with a larger cap moves the buffer under an earlier reader."""

    def __init__(self, ctx: Any, cap: int) -> None:
        self._ctx_arg = ctx
        n, header, ids = saem_moe_routing_sink(ctx, max(int(cap), 1))
        # memoryview indexing is plain Python (no NumPy call per field)
        self._header = memoryview((ctypes.c_int64 * SAEM_SINK_HEADER).from_address(header)).cast("B").cast("q")
        self._ids = np.ctypeslib.as_array((ctypes.c_int16 * n).from_address(ids))
        # the sink as one token's [1, n_moe_layers, n_used], made at the first such read (a
        # context's MoE layers and n_used are fixed, so every one-token ubatch has that shape)
        self._one: np.ndarray | None = None

    def view(self) -> np.ndarray:
        """int16 [n_tokens, n_moe_layers, n_used], what ``saem_moe_get_last_routing`` returns, as
        a view of the native buffer: valid only until the next decode (``read`` copies it)."""
        h = self._header
        n_tokens = h[SAEM_SINK_N_TOKENS]
        one = self._one
        if n_tokens == 1 and one is not None:
            return one
        need = h[SAEM_SINK_NEED]
        if need > self._ids.size:
            return saem_moe_get_last_routing(self._ctx_arg, need)
        view = self._ids[:need].reshape(n_tokens, h[SAEM_SINK_N_LAYERS], h[SAEM_SINK_N_USED])
        if n_tokens == 1:
            self._one = view
        return view

    def one_token(self) -> tuple[np.ndarray, int] | None:
        """(``view()``, ``slot_uses``) when the last ubatch was one token, else None: a decode
        step's read in one call, not three (after a decode each call costs microseconds)."""
        h = self._header
        if h[SAEM_SINK_N_TOKENS] != 1:
            return None
        one = self._one
        return (one if one is not None else self.view()), h[SAEM_SINK_N_SLOT_USES]

    def read(self) -> np.ndarray:
        """The same routing as a new array."""
        return np.array(self.view())

    @property
    def n_tokens(self) -> int:
        """Tokens of the last ubatch (what ``view()`` returns rows for)."""
        return self._header[SAEM_SINK_N_TOKENS]

    @property
    def slot_uses(self) -> int:
        """Of the last ubatch's (token, layer, k) uses, those a slot served under the maps that
        ubatch ran with (counted natively when the decode ran)."""
        return self._header[SAEM_SINK_N_SLOT_USES]


def saem_moe_set_stock_min_batch(ctx: Any, n: int) -> None:
    """int32_t saem_moe_set_stock_min_batch(struct llama_context * ctx, int32_t n);
    -- ubatches of >= n tokens use the stock graph"""
    _call("saem_moe_set_stock_min_batch", _ctx(ctx), int(n))


def saem_moe_get_stock_min_batch(ctx: Any) -> int:
    """int32_t saem_moe_get_stock_min_batch(const struct llama_context * ctx);"""
    return _call("saem_moe_get_stock_min_batch", _ctx(ctx))


# ---------------------------------------------------------------------------------------------
# RAM tier (experts in the model file's mapping)


def saem_ram_experts_mapped(ctx: Any) -> tuple[bool, str]:
    """int32_t saem_ram_experts_mapped(const struct llama_context * ctx);

    Returns (mapped, why not: saem_last_error's message when not mapped, else "")."""
    mapped = bool(_call("saem_ram_experts_mapped", _ctx(ctx)))
    return mapped, "" if mapped else saem_last_error()


def saem_ram_expert_ranges(ctx: Any, il: int, expert: int) -> list[tuple[int, int]]:
    """int32_t saem_ram_expert_ranges(const struct llama_context * ctx, int32_t il, int32_t expert,
    uint64_t * addr, uint64_t * nbytes, int32_t cap);

    Returns [(address, nbytes)], one per expert matrix (gate_up|up, gate, down)."""
    addr, nbytes = (ctypes.c_uint64 * 3)(), (ctypes.c_uint64 * 3)()
    n = _call("saem_ram_expert_ranges", _ctx(ctx), int(il), int(expert), addr, nbytes, 3)
    return [(int(addr[k]), int(nbytes[k])) for k in range(min(n, 3))]


def saem_ram_prefetch(ctx: Any, il: int, experts: Sequence[int], method: int = SAEM_RAM_PREFETCH_MADVISE) -> None:
    """int32_t saem_ram_prefetch(struct llama_context * ctx, int32_t il, const int32_t * experts,
    int32_t n, int32_t method);   -- SAEM_RAM_PREFETCH_MADVISE / SAEM_RAM_PREFETCH_THREAD"""
    arr = _i32_array(experts, "experts")
    _call("saem_ram_prefetch", _ctx(ctx), int(il), arr, len(arr), int(method))


def saem_ram_set_route_prefetch(ctx: Any, on: bool) -> None:
    """int32_t saem_ram_set_route_prefetch(struct llama_context * ctx, int32_t on);"""
    _call("saem_ram_set_route_prefetch", _ctx(ctx), 1 if on else 0)


def saem_ram_route_prefetched(ctx: Any) -> int:
    """int64_t saem_ram_route_prefetched(const struct llama_context * ctx);"""
    return _call("saem_ram_route_prefetched", _ctx(ctx))


def saem_ram_prefetch_wait(ctx: Any) -> None:
    """int32_t saem_ram_prefetch_wait(struct llama_context * ctx);"""
    _call("saem_ram_prefetch_wait", _ctx(ctx))


def saem_ram_release(ctx: Any, il: int, experts: Sequence[int], advice: int = SAEM_RAM_RELEASE_AUTO) -> int:
    """int32_t saem_ram_release(struct llama_context * ctx, int32_t il, const int32_t * experts,
    int32_t n, int32_t advice);   -- returns the SAEM_RAM_RELEASE_* advice applied"""
    arr = _i32_array(experts, "experts")
    return _call("saem_ram_release", _ctx(ctx), int(il), arr, len(arr), int(advice))


def saem_ram_expert_residency(ctx: Any, il: int, expert: int) -> tuple[int, int]:
    """int32_t saem_ram_expert_residency(const struct llama_context * ctx, int32_t il, int32_t expert,
    uint64_t * resident_pages, uint64_t * total_pages);   -- returns (resident, total) pages"""
    res, tot = ctypes.c_uint64(0), ctypes.c_uint64(0)
    _call("saem_ram_expert_residency", _ctx(ctx), int(il), int(expert), ctypes.byref(res), ctypes.byref(tot))
    return int(res.value), int(tot.value)


def saem_ram_lock_non_expert(ctx: Any) -> int:
    """int32_t saem_ram_lock_non_expert(struct llama_context * ctx, uint64_t * locked_bytes);
    -- returns the bytes locked"""
    n = ctypes.c_uint64(0)
    _call("saem_ram_lock_non_expert", _ctx(ctx), ctypes.byref(n))
    return int(n.value)


def saem_ram_unlock_non_expert(ctx: Any) -> None:
    """int32_t saem_ram_unlock_non_expert(struct llama_context * ctx);"""
    _call("saem_ram_unlock_non_expert", _ctx(ctx))
