"""A GGUF model's weights in the layout this CPU's kernels run, kept on disk after its first load.

Most of a GGUF load is repacking: blocks re-laid for the kernels (loader/gguf.py -> QuantWeight), converted for int8
activations, tiled for AMX, then copied onto huge pages (kernels/arena.py). After a first load, `save` writes what
the model then holds: the quantized weights as one file laid out like the huge-page arena, the other tensors (norms,
biases, float layers) as safetensors, and a JSON index of where each weight sits. `restore` rebuilds the same model
from them without reading the GGUF's tensors: the weights are the file itself, mapped read-only (as llama.cpp maps
its GGUF), on 2 MiB pages where the page cache holds it in large folios; a warm load copies nothing, and processes
mapping one file (data-parallel replicas) share its memory. Every page is faulted in at load, but an embedding
table's (a tied LM head holds a copy of its own): its lookups touch only their rows, so the rest costs no memory.
A first load writes the entry, then maps it too. Files are never rewritten in place (a new file is renamed over the
old), since running processes map them.

An entry is keyed by the GGUF's identity (real path, size, modification time, inode and a hash of its first MiB:
the whole file is not hashed, which would cost more than the load saves), the kernel library (its file name holds
its build's digest) and int8 kernel, the activation dtype, the tensor-parallel shard, and a hash of the code that
lays weights out; any change makes another entry. A damaged entry is dropped and the model loaded from the GGUF.
Entries whose GGUF is gone, then the least recently used beyond VERISPEC_LAYOUT_CACHE_GB (default 8), are deleted.
The cache lives in <VERISPEC_CACHE or ~/.cache/verispec>/layouts; VERISPEC_LAYOUT_CACHE=0 turns it off, a folder
path puts it there.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from verispec.kernels import build
from verispec.kernels.arena import (
    arena_layout,
    huge_pages_enabled,
    slot_weight,
    weight_slots,
)
from verispec.kernels.qweight import QuantWeight
from verispec.layers.embedding import Embedding

# bumped when the entry's format changes
VERSION = 2
# the code whose changes change a layout (beside the kernel library, keyed by its own digest)
_LAYOUT_CODE = (
    "kernels/qweight.py",
    "kernels/arena.py",
    "loader/gguf.py",
    "loader/weights.py",
    "loader/layout_cache.py",
    "layers/linear.py",
    "layers/embedding.py",
    "distributed/shard.py",
)


@dataclass
class Entry:
    """One cached model: its files share the stem `path` (.json index, .bin weights, .safetensors tensors)."""

    path: Path
    index: dict


def cache_root() -> Path | None:
    """The cache folder, or None when VERISPEC_LAYOUT_CACHE=0."""
    where = os.environ.get("VERISPEC_LAYOUT_CACHE", "")
    if where == "0":
        return None
    return Path(where) if where else build.cache_dir().parent / "layouts"


def entry_key(gguf: Path, activation_dtype: str, shard: tuple[int, int] | None) -> str | None:
    """The key of a GGUF's entry for this process's kernels and options; None where nothing is cached (no kernel
    library, or weights not on huge pages)."""
    lib = build.load_qgemm()
    if lib is None or not huge_pages_enabled():
        return None
    st = gguf.stat()
    with gguf.open("rb") as f:
        head = f.read(1 << 20)
    package = Path(__file__).resolve().parent.parent
    code = b"".join((package / name).read_bytes() for name in _LAYOUT_CODE)
    ident = [
        VERSION,
        str(gguf.resolve()),
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
        hashlib.sha256(head).hexdigest(),
        Path(lib._name).name,
        build.int8_isa(lib) if activation_dtype == "int8" else None,
        activation_dtype,
        shard,
        hashlib.sha256(code).hexdigest(),
    ]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:32]


def find(root: Path | None, key: str | None) -> Entry | None:
    """The complete entry for `key`, or None."""
    if root is None or key is None:
        return None
    stem = root / key
    try:
        index = json.loads(stem.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    if index.get("version") != VERSION:
        return None
    return Entry(stem, index)


def save(root: Path | None, key: str | None, net: nn.Module, source: Path) -> Entry | None:
    """Write `net`'s weights as an entry for `key` (the index last, under its final name: an entry is whole or
    absent). -> the entry; None, the cache as it was, where a full disk or a read-only folder refuses it."""
    if root is None or key is None:
        return None
    slots = weight_slots(net)
    weights = [slot_weight(m, i) for _, m, i in slots]
    offsets, total = arena_layout([w.blocks.nbytes for w in weights])
    stem, tmp = root / key, f".{uuid.uuid4().hex}.tmp"
    parts = [stem.with_suffix(".bin"), stem.with_suffix(".safetensors"), stem.with_suffix(".json")]
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(str(parts[0]) + tmp, "wb") as f:
            for w, off in zip(weights, offsets):
                f.seek(off)
                f.write(np.ascontiguousarray(w.blocks).data)
            f.truncate(total)
        tensors = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
        save_file(tensors, str(parts[1]) + tmp)
        index = {
            "version": VERSION,
            "source": str(source.resolve()),
            "bytes": total,
            "weights": [
                {
                    "module": name,
                    "part": i,
                    "fmt": w.fmt,
                    "dtype": w.blocks.dtype.str,
                    "blocks": list(w.blocks.shape),
                    "shape": list(w.shape),
                    "offset": off,
                    # an embedding table is read row by row (a tied LM head has a copy of its own): its
                    # pages are left to the lookups
                    "lazy": isinstance(m, Embedding),
                }
                for (name, m, i), w, off in zip(slots, weights, offsets)
            ],
        }
        Path(str(parts[2]) + tmp).write_text(json.dumps(index))
        for p in parts:
            os.replace(str(p) + tmp, p)
    except OSError:
        for p in parts:
            try:
                Path(str(p) + tmp).unlink(missing_ok=True)
            except OSError:
                pass
        return None
    prune(root)
    return Entry(stem, index)


def restore(entry: Entry, net: nn.Module) -> bool:
    """Fill `net` (built as the cached model was, its tensors allocated) from `entry`: the tensors, then every
    quantized weight as a view of the entry's weights file, mapped (map_weights). False, with the entry deleted,
    where the files are damaged or do not fit `net` (the caller then loads from the GGUF)."""
    index = entry.index
    try:
        tensors = load_file(str(entry.path.with_suffix(".safetensors")))
        modules = dict(net.named_modules())
        _restore_tensors(net, modules, tensors)
        weights = map_weights(entry.path.with_suffix(".bin"), index["bytes"])
        # each module's parts, in the order the index lists them (weight_slots' order)
        parts: dict[str, list[QuantWeight]] = {}
        for w in index["weights"]:
            raw = weights[w["offset"] : w["offset"] + _nbytes(w)]
            if not w["lazy"]:
                # fault the pages in now, not in the first forwards
                int(raw[::4096].sum())
            qw = QuantWeight(w["fmt"], raw.view(np.dtype(w["dtype"])).reshape(w["blocks"]), tuple(w["shape"]))
            if w["part"] is None:
                modules[w["module"]].qweight = qw
            else:
                parts.setdefault(w["module"], []).append(qw)
        for name, qws in parts.items():
            modules[name].qparts = qws
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError):
        forget(entry)
        return False
    for m in net.modules():
        # float layers pack their weight for MKL once loaded (Dense.finish_loading; a model just loaded has)
        if hasattr(m, "pack") and not getattr(m, "quantized", True) and m._packed is None:
            m.pack()
    os.utime(entry.path.with_suffix(".json"))
    return True


def map_weights(path: Path, nbytes: int) -> np.ndarray:
    """The weights file mapped read-only [nbytes] uint8, asking for huge pages: where the page cache holds it in
    2 MiB folios (ext4 and others on recent kernels) the mapping uses 2 MiB entries, as the anonymous huge-page arena
    does, without copying a byte. Its memory is the page cache's, shared with every process mapping the file."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != nbytes:
            raise ValueError("the cached weights file has the wrong size")
        buf = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(buf, dtype=np.uint8)


def _restore_tensors(net: nn.Module, modules: dict[str, nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    """Every state tensor of `net` from `tensors`: copied in where shapes agree; a quantized layer's released
    (empty) parameter replaced as loading had replaced it."""
    own = net.state_dict(keep_vars=True)
    if set(own) != set(tensors):
        raise ValueError("the cached tensors are not the model's")
    for name, value in tensors.items():
        module_name, _, leaf = name.rpartition(".")
        current = own[name]
        if tuple(current.shape) == tuple(value.shape):
            with torch.no_grad():
                current.copy_(value)
        elif value.numel() == 0 and isinstance(current, nn.Parameter):
            setattr(modules[module_name], leaf, nn.Parameter(value, requires_grad=False))
        else:
            raise ValueError(
                f"cached tensor {name} has shape {tuple(value.shape)}, expected {tuple(current.shape)}"
            )


def forget(entry: Entry) -> None:
    for suffix in (".json", ".bin", ".safetensors"):
        entry.path.with_suffix(suffix).unlink(missing_ok=True)


def prune(root: Path) -> None:
    """Delete unfinished writes, entries whose GGUF is gone, then the least recently used while the cache holds
    more than VERISPEC_LAYOUT_CACHE_GB."""
    cap = float(os.environ.get("VERISPEC_LAYOUT_CACHE_GB", "8")) * 1e9
    for partial in root.glob("*.tmp"):
        # a write that never finished (its process was killed), an hour old
        try:
            if time.time() - partial.stat().st_mtime > 3600:
                partial.unlink()
        except OSError:
            pass
    kept = []
    for index_file in root.glob("*.json"):
        entry = find(root, index_file.stem)
        if entry is None or not Path(entry.index.get("source", "")).is_file():
            forget(Entry(index_file.with_suffix(""), {}))
            continue
        size = sum(
            index_file.with_suffix(s).stat().st_size
            for s in (".bin", ".safetensors", ".json")
            if index_file.with_suffix(s).exists()
        )
        kept.append((index_file.stat().st_mtime, size, entry))
    total = sum(size for _, size, _ in kept)
    for _, size, entry in sorted(kept, key=lambda k: k[0]):
        if total <= cap:
            break
        forget(entry)
        total -= size


def _nbytes(w: dict) -> int:
    return int(np.prod(w["blocks"])) * np.dtype(w["dtype"]).itemsize
