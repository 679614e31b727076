"""A kernel's books in one argument: the state arrays a Numba kernel reads and writes on every
step, reached through one int64 table of (address, shape) rows instead of one argument each.

Why: after a decode, each array argument of a kernel call costs about 0.6 us before the kernel
runs (the dispatcher matches its type and unboxes it, with the caches cold). Measured token by
token in the live engine: a kernel given 24 arrays took 19.5 us a call, the same kernel reaching
them through one table 7.7 us, a kernel with no argument 4.1 us (docs/POLICIES_HISTORY.md, per-token
cost). The per-step inputs (a step's routing, its pieces) stay arguments; only books kept between
steps go into the table.

Safety: the ``KernelBooks`` object holds a reference to every array its table points to (keep
it, not only its table), so a kernel never reads freed memory; each array is checked against its
declared dtype, rank and C order when set. An array replaced on the Python side must be set again
(``KernelBooks.set``): until then the kernel keeps working on the old one. A deep copy of the
owner gets books over its copied arrays (keep the books before the table among the owner's
attributes, so that its copy of the table is the new one). A kernel writes only
the books its component owns (a shared read-only table, such as the cue automaton's, is read).

A kernel reads entry ``i`` with the accessor of its declared dtype and rank (``f64_2d(tab, i)``
...), which builds an array view of the same Numba type the array had as an argument, so the
kernels called with those views compile to the same code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

MAX_NDIM = 4
# a table row: the data address, then the shape (unused dimensions 1)
ROW = 1 + MAX_NDIM


@dataclass(frozen=True)
class Book:
    """One array of a kernel's books: its name (the key ``KernelBooks`` takes it by), dtype and rank."""

    name: str
    dtype: type
    ndim: int


class KernelBooks:
    """The arrays of ``spec``, in that order, as one int64 table [len(spec), ROW] (``table``)."""

    def __init__(self, spec: Sequence[Book], arrays: Mapping[str, np.ndarray]) -> None:
        self.spec = tuple(spec)
        self._index = {b.name: i for i, b in enumerate(self.spec)}
        missing = [b.name for b in self.spec if b.name not in arrays]
        extra = sorted(set(arrays) - set(self._index))
        if missing or extra:
            raise ValueError(f"kernel books: missing {missing}, not in the spec {extra}")
        self.table = np.ones((len(self.spec), ROW), np.int64)
        self._arrays: list[np.ndarray | None] = [None] * len(self.spec)
        for b in self.spec:
            self.set(b.name, arrays[b.name])

    def set(self, name: str, array: np.ndarray) -> None:
        """Point entry ``name`` at ``array`` (kept alive here until replaced)."""
        i = self._index[name]
        b = self.spec[i]
        if not isinstance(array, np.ndarray) or array.dtype != np.dtype(b.dtype) or array.ndim != b.ndim \
                or not array.flags.c_contiguous:
            got = (f"{array.dtype} [{array.ndim}d, {'C' if array.flags.c_contiguous else 'not C'}]"
                   if isinstance(array, np.ndarray) else type(array).__name__)
            raise ValueError(f"kernel books: {name} must be a C-ordered {np.dtype(b.dtype)} array of rank "
                             f"{b.ndim}, not {got}")
        row = self.table[i]
        row[:] = 1
        row[0] = array.ctypes.data
        row[1:1 + b.ndim] = array.shape
        self._arrays[i] = array

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[self._index[name]]

    def __deepcopy__(self, memo: dict) -> "KernelBooks":
        """A copy over copies of the arrays (the same copies as the owner's own attributes, through
        ``memo``), with a table of their addresses: a copied table would point at the original's
        arrays. The new table is entered in ``memo`` for an owner that also keeps the table."""
        from copy import deepcopy

        new = KernelBooks(self.spec, {b.name: deepcopy(a, memo) for b, a in zip(self.spec, self._arrays)})
        memo[id(self)] = new
        memo[id(self.table)] = new.table
        return new


def entry_point(kernel, *args):
    """The compiled entry point of Numba ``kernel`` for the types ``args`` have (compiled, or
    loaded from Numba's cache, now if need be): what the dispatcher calls once it has typed a
    call's arguments, without the typing.

    Why: after a decode, a kernel call through its dispatcher spends about 7 us typing its
    arguments and finding the overload (measured in the live engine, alternating tokens: 17.1 us
    through the dispatcher against 9.5 us through the entry point; docs/POLICIES_HISTORY.md, per-token
    cost). A decode step makes two to four such calls.

    Unsafe by design: the entry point converts scalars (an int, a float, a bool), but takes any
    array or buffer as the compiled type without checking its dtype, rank or order. Call it only
    with arrays that are the very objects it was bound with (checked with ``is``: one pointer
    compare) or whose type is fixed by construction (a ``KernelBooks`` table, a ``bytes``
    piece); any other call goes through ``kernel`` itself. Without the JIT (NUMBA_DISABLE_JIT)
    ``kernel`` is returned."""
    if not hasattr(kernel, "overloads"):
        return kernel
    return kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))


@intrinsic
def _address(typingctx, addr):
    """An int64 address as a void pointer (what ``carray`` takes)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.int64), codegen


@njit(cache=True, inline="always")
def _shape(tab, i, ndim):
    """Entry ``i``'s shape, its first ``ndim`` dimensions (a literal at each accessor)."""
    if ndim == 1:
        return (tab[i, 1],)
    if ndim == 2:
        return (tab[i, 1], tab[i, 2])
    if ndim == 3:
        return (tab[i, 1], tab[i, 2], tab[i, 3])
    return (tab[i, 1], tab[i, 2], tab[i, 3], tab[i, 4])


def _accessor(dtype: type, ndim: int):
    """A kernel's view of table entry ``i`` as a C-ordered ``dtype`` array of rank ``ndim`` (the
    Numba type the array has as an argument)."""
    @njit(inline="always")
    def entry(tab, i):
        return carray(_address(tab[i, 0]), _shape(tab, i, ndim), dtype)
    return entry


# Accessors: entry i of a table as an array of the declared dtype and rank.
f64_1d, f64_2d, f64_3d = (_accessor(np.float64, n) for n in (1, 2, 3))
i64_1d, i64_2d = (_accessor(np.int64, n) for n in (1, 2))
i32_1d, i32_2d, i32_3d, i32_4d = (_accessor(np.int32, n) for n in (1, 2, 3, 4))
i16_4d = _accessor(np.int16, 4)
u8_1d = _accessor(np.uint8, 1)
