"""Anonymous memory for the CPU's big buffers: one huge-page-backed block for a model's kept-quantized weights,
small pages for the KV cache (runner/kv_cache.py).

Every decode step streams all of a model's weights. Each projection is a separate numpy array of well under 2 MiB,
so the OS backs them with 4 KiB pages: a step touches tens of thousands of pages, more than the TLB holds, and pays
a page walk every 4 KiB. Moved into one anonymous mapping that asks for transparent huge pages (MADV_HUGEPAGE;
Linux's default THP mode 'madvise' honours it), the same bytes sit on a few dozen pages of 2 MiB. Where the OS has no huge pages to give (THP 'never', fragmented memory, not Linux), the mapping
still works with small pages: only the speed differs, never a result.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from itertools import accumulate

import numpy as np
from torch import nn

from verispec.kernels.qweight import QuantWeight

# huge page size on x86-64 Linux; the mapping is laid out from a 2 MiB boundary
_HUGE = 2 << 20
# each weight starts on a cache line
_ALIGN = 64


def anonymous_buffer(nbytes: int, huge_pages: bool) -> np.ndarray:
    """A zeroed uint8 array of nbytes in a private anonymous mapping: the OS hands out zero pages lazily, so it
    costs nothing until written. huge_pages: ask for 2 MiB pages (and start on a 2 MiB boundary), else refuse them.
    A kernel without transparent huge pages gives small pages either way."""
    pad = _HUGE if huge_pages else 0
    buf = mmap.mmap(-1, max(nbytes + pad, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:
            pass
    whole = np.frombuffer(buf, dtype=np.uint8)
    start = -whole.ctypes.data % _HUGE if huge_pages else 0
    return whole[start : start + nbytes]


def weight_slots(module: nn.Module) -> list[tuple[str, nn.Module, int | None]]:
    """Every kept-quantized weight of `module` in module order (the order a forward reads them): (module name,
    module, index in its qparts or None for its qweight)."""
    slots = []
    for name, m in module.named_modules():
        if getattr(m, "qweight", None) is not None:
            slots.append((name, m, None))
        slots += [(name, m, i) for i in range(len(getattr(m, "qparts", None) or []))]
    return slots


def slot_weight(m: nn.Module, i: int | None) -> QuantWeight:
    return m.qweight if i is None else m.qparts[i]


def set_slot_weight(m: nn.Module, i: int | None, w: QuantWeight) -> None:
    if i is None:
        m.qweight = w
    else:
        m.qparts[i] = w


def arena_layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of weights of `sizes` bytes laid out one after another, each on a cache line; -> (offsets, total)."""
    offsets = list(accumulate((-(-n // _ALIGN) * _ALIGN for n in sizes), initial=0))
    return offsets[:-1], offsets[-1]


def huge_pages_enabled() -> bool:
    """VERISPEC_HUGE_PAGES=0 keeps every weight in its own (small-page) array."""
    return os.environ.get("VERISPEC_HUGE_PAGES", "1") != "0"


def move_weights_to_huge_pages(module: nn.Module) -> int:
    """Copy the quantized blocks of every layer of `module` that keeps them (Dense.qweight / qparts,
    Embedding.qweight) into one huge-page buffer laid out by `arena_layout`, in `weight_slots` order, and point the
    layers at it. Call it once the layouts are final (after int8 conversion) and before anything records the
    weights' addresses (FusedLayers). -> bytes moved (0 when huge pages are off)."""
    if not huge_pages_enabled():
        return 0
    # no reference to the weights themselves, so that each copy frees its source at once and the peak stays near
    # one copy of the weights
    slots = [(m, i) for _, m, i in weight_slots(module)]
    offsets, total = arena_layout([slot_weight(m, i).blocks.nbytes for m, i in slots])
    if not total:
        return 0
    arena = anonymous_buffer(total, huge_pages=True)
    for (m, i), off in zip(slots, offsets):
        q = slot_weight(m, i)
        dst = arena[off : off + q.blocks.nbytes].view(q.blocks.dtype).reshape(q.blocks.shape)
        dst[...] = q.blocks
        set_slot_weight(m, i, QuantWeight(q.fmt, dst, q.shape))
        del q
    _release_freed_memory()
    return total


def _release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim): the small-page copies just dropped would
    otherwise stay resident until the heap reuses them."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
