"""llama.cpp's ``-ot/--override-tensor PATTERN=BUFT``: parsed, resolved, and merged with our experts-on-host override.

llama.cpp (common/arg.cpp ``parse_tensor_buffer_overrides``) splits the value at commas, each
item at its first ``=``, and looks the buffer type up by name among the default buffer types of
the ggml devices (``CPU``, ``CUDA0``, ...). The model loader walks the override list in order and
the first pattern that ``std::regex_search``-es a tensor name decides its buffer type.

With expert management on, the engine's own override (every expert tensor into host memory the
cache copies from) comes first, so it decides every expert tensor; the user's patterns follow and
decide everything else. A user pattern that also matches expert tensors is therefore checked up
front: into host memory (``CPU``) it agrees with expert management and is noted as redundant for
the experts; into a device buffer it contradicts it, and that is an error that says what to use.

The buffer-type names come from ggml's device registry (ggml-backend.h), reached with ctypes
through the library handle llama-cpp-python loaded (libllama links ggml), as ``native_api`` does
for our own C API.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Any

from saem_gguf.errors import SaemError


@dataclass(frozen=True)
class TensorOverride:
    pattern: str  # a regular expression searched in tensor names (std::regex, ECMAScript)
    buffer_type: str  # a ggml buffer type name: CPU, CUDA0, ...

    def __str__(self) -> str:
        return f"{self.pattern}={self.buffer_type}"


def parse_overrides(text: str) -> list[TensorOverride]:
    """``'exps=CPU,blk\\.0\\.=CUDA0'`` -> overrides, as llama.cpp splits them (commas, first ``=``)."""
    out = []
    for item in text.split(","):
        pattern, eq, buft = item.partition("=")
        if not eq or not pattern or not buft:
            raise SaemError(f"-ot {text!r}: each item is PATTERN=BUFFER_TYPE (e.g. exps=CPU), got {item!r}")
        try:
            re.compile(pattern)
        except re.error as e:
            raise SaemError(f"-ot {text!r}: {pattern!r} is not a regular expression ({e})") from None
        out.append(TensorOverride(pattern, buft))
    return out


def device_buffer_types(llama_cpp_module: Any) -> dict[str, int]:
    """Name -> ggml_backend_buffer_type_t of every ggml device's default buffer type."""
    lib = llama_cpp_module.llama_cpp._lib
    dev_count = lib.ggml_backend_dev_count
    dev_count.argtypes, dev_count.restype = [], ctypes.c_size_t
    dev_get = lib.ggml_backend_dev_get
    dev_get.argtypes, dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    dev_buft = lib.ggml_backend_dev_buffer_type
    dev_buft.argtypes, dev_buft.restype = [ctypes.c_void_p], ctypes.c_void_p
    buft_name = lib.ggml_backend_buft_name
    buft_name.argtypes, buft_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    llama_cpp_module.llama_backend_init()  # loads the backends, so the device list is complete
    found = {}
    for i in range(dev_count()):
        buft = dev_buft(dev_get(i))
        if buft:
            found[buft_name(buft).decode()] = int(buft)
    return found


def check_against_experts(overrides: list[TensorOverride], expert_tensor_names: list[str],
                          managed: bool) -> list[str]:
    """Notes for overrides that meet expert tensors; an error when one contradicts expert management."""
    notes = []
    for o in overrides:
        hit = next((n for n in expert_tensor_names if re.search(o.pattern, n)), None)
        if hit is None or not managed:
            continue
        if o.buffer_type != "CPU":
            raise SaemError(
                f"-ot {o} would put expert tensors (e.g. {hit}) in {o.buffer_type} memory, but expert "
                f"management keeps every expert in host memory and caches them on the GPU: narrow the "
                f"pattern to non-expert tensors, or keep all experts resident with --ecr 100%")
        notes.append(f"-ot {o}: expert tensors (e.g. {hit}) already stay in host memory under expert "
                     f"management; the pattern decides only the other tensors it matches")
    return notes


def resolve(llama_cpp_module: Any, overrides: list[TensorOverride]) -> list[tuple[bytes, int]]:
    """(pattern, buffer type pointer) per override; an unknown buffer type name is an error that lists
    the available ones (llama.cpp prints that list too)."""
    if not overrides:
        return []
    bufts = device_buffer_types(llama_cpp_module)
    rows = []
    for o in overrides:
        if o.buffer_type not in bufts:
            raise SaemError(f"-ot {o}: unknown buffer type {o.buffer_type!r} "
                            f"(available: {', '.join(sorted(bufts)) or 'none'})")
        rows.append((o.pattern.encode(), bufts[o.buffer_type]))
    return rows


def override_array(rows: list[tuple[bytes, int]]) -> Any:
    """The NULL-terminated ``llama_model_tensor_buft_override`` array of ``rows`` in order (the first
    matching pattern decides). Keep it alive until the model is loaded: it holds the patterns."""
    from saem_gguf import native_api as na

    arr = (na.llama_model_tensor_buft_override * (len(rows) + 1))()
    for i, (pattern, buft) in enumerate(rows):
        arr[i].pattern = pattern
        arr[i].buft = buft
    arr[len(rows)].pattern = None
    arr[len(rows)].buft = None
    return arr
