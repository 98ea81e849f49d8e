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


def move_weights_to_huge_pages(module: nn.Module) -> int:
    """Copy the quantized blocks of every layer of `module` that keeps them (Dense.qweight / qparts, Embedding.qweight) into one huge-page
    buffer, in module order (the order a forward reads them), and point the layers at it. Call it once the layouts
    are final (after int8 conversion) and before anything records the weights' addresses (FusedLayers).
    VERISPEC_HUGE_PAGES=0 turns it off. -> bytes moved."""
    if os.environ.get("VERISPEC_HUGE_PAGES", "1") == "0":
        return 0
    # (module, index in its qparts or None for its qweight); no reference to the weights themselves, so that each
    # copy frees its source at once and the peak stays near one copy of the weights
    slots = []
    for m in module.modules():
        if getattr(m, "qweight", None) is not None:
            slots.append((m, None))
        slots += [(m, i) for i in range(len(getattr(m, "qparts", None) or []))]

    def weight(m: nn.Module, i: int | None) -> QuantWeight:
        return m.qweight if i is None else m.qparts[i]

    sizes = [weight(m, i).blocks.nbytes for m, i in slots]
    # each weight starts on a cache line
    offsets = list(accumulate((-(-n // _ALIGN) * _ALIGN for n in sizes), initial=0))
    total = offsets.pop()
    if not total:
        return 0
    arena = anonymous_buffer(total, huge_pages=True)
    for (m, i), off in zip(slots, offsets):
        q = weight(m, i)
        dst = arena[off : off + q.blocks.nbytes].view(q.blocks.dtype).reshape(q.blocks.shape)
        dst[...] = q.blocks
        moved = QuantWeight(q.fmt, dst, q.shape)
        del q
        if i is None:
            m.qweight = moved
        else:
            m.qparts[i] = moved
    _release_freed_memory()
    return total


def _release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim): the small-page copies just dropped would
    otherwise stay resident until the heap reuses them."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
