"""Load a GGUF checkpoint as float32 tensors with Hugging Face names, an HF-style config and a tokenizer.

The header is parsed here (the `gguf` package's `GGUFReader` builds a numpy view per metadata string,
which takes ~15 s for a 262k-token vocabulary); tensor data is dequantised with `gguf.quants.dequantize`.
The layout fixes llama.cpp's converter applies are undone as transformers' GGUF loader does:
the rotary row permutation of Q/K for the `llama` architecture, and the `+1` folded into Gemma's norms.
"""

from __future__ import annotations

import mmap
import re
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from verispec import progress
from verispec.kernels.qweight import QuantWeight
from verispec.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q8_0,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
    }
)

# GGUF metadata value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = range(10)
_UINT64, _INT64, _FLOAT64 = 10, 11, 12
_SCALAR_FORMATS = {
    _UINT8: "<B",
    _INT8: "<b",
    _UINT16: "<H",
    _INT16: "<h",
    _UINT32: "<I",
    _INT32: "<i",
    _FLOAT32: "<f",
    _BOOL: "<?",
    _UINT64: "<Q",
    _INT64: "<q",
    _FLOAT64: "<d",
}

_HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp-only tensors with no transformers counterpart.
_SKIPPED_TENSORS = ("rope_freqs.weight",)
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class GGUFTensorInfo:
    name: str
    # numpy / PyTorch order (GGUF stores dims innermost first)
    shape: tuple[int, ...]
    ggml_type: int
    # absolute file offset of the data
    offset: int
    nbytes: int = 0


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]


@dataclass
class GGUFCheckpoint:
    hf_config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    chat_template: str | None
    eos_token_ids: list[int] = field(default_factory=list)


def load_gguf(path: str | Path, keep_quantized: bool = False, with_tensors: bool = True) -> GGUFCheckpoint:
    """Read a GGUF file: config, tensors (HF names) and tokenizer.

    Tensors are dequantised to float32, except, with keep_quantized, the 2-D Q4_0 / Q4_1 / Q4_K / Q5_0 / Q8_0 / Q6_K
    weights, which come back as QuantWeight (repacked blocks that dequantize to the same float32 values) for the CPU
    kernels. with_tensors=False: the header's checks, config and tokenizer only (tensors empty).
    """
    header = read_gguf_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{header.path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _check_tensor_types(header)
    _check_tensor_bounds(header)
    names = [info.name for info in header.tensors]
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{header.path}: GGUF file has no tokenizer.ggml.tokens")
    config = build_hf_config(arch, meta, names, path=header.path)
    tensors = _load_tensors(header, arch, config, keep_quantized) if with_tensors else {}
    tokenizer = Tokenizer.from_gguf_fields(meta, arch)
    return GGUFCheckpoint(
        hf_config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        eos_token_ids=list(tokenizer.eos_token_ids),
    )


def load_gguf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file under its own name: float types dequantized to float32, I32 as int32. For draft
    weights stored as GGUF blocks beside a config.json (a shipped draft's Q8_0 weights, `train/eagle3.save`), which
    the quantized CPU path re-blocks into the same Q8_0 blocks."""
    header = read_gguf_header(path)
    ints = {i.name for i in header.tensors if i.ggml_type == GGMLQuantizationType.I32}
    floats = [i for i in header.tensors if i.name not in ints]
    _check_tensor_types(GGUFHeader(header.path, header.version, header.metadata, floats))
    _check_tensor_bounds(header)
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    tensors = {}
    for info in header.tensors:
        if info.name in ints:
            raw = np.asarray(data[info.offset : info.offset + info.nbytes]).view(np.int32)
            tensors[info.name] = torch.from_numpy(raw.copy().reshape(info.shape))
        else:
            tensors[info.name] = torch.from_numpy(_dequantize(data, info))
    return tensors


# ---- header -----------------------------------------------------------------------------------


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF header (metadata and tensor table); ValueError naming the path if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path}: not a GGUF file (only {size} bytes)")
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != GGUF_MAGIC:
                raise ValueError(f"bad magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r}")
            return _parse_header(path, buf)
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError, IndexError) as exc:
        raise ValueError(f"{path}: not a valid GGUF file: {exc}") from exc


def _parse_header(path: Path, buf: mmap.mmap) -> GGUFHeader:
    reader = _Reader(buf)
    reader.pos = 4
    version = reader.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (big-endian or too old/new)")
    n_tensors = reader.scalar("<Q")
    n_kv = reader.scalar("<Q")
    if n_tensors > len(buf) or n_kv > len(buf):
        raise ValueError(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("<I"))
    infos = [_read_tensor_info(reader) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0:
        raise ValueError(f"bad alignment {alignment}")
    data_start = -(-reader.pos // alignment) * alignment
    for info in infos:
        info.offset += data_start
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=infos)


def _read_tensor_info(reader: _Reader) -> GGUFTensorInfo:
    name = reader.string()
    n_dims = reader.scalar("<I")
    if n_dims > 8:
        raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
    dims = [reader.scalar("<Q") for _ in range(n_dims)]
    ggml_type = reader.scalar("<I")
    offset = reader.scalar("<Q")
    return GGUFTensorInfo(name=name, shape=tuple(reversed(dims)), ggml_type=ggml_type, offset=offset)


class _Reader:
    """Little-endian cursor over the header bytes."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def need(self, nbytes: int) -> None:
        if nbytes < 0 or self.pos + nbytes > len(self.buf):
            raise ValueError(f"truncated header (need {nbytes} bytes at offset {self.pos})")

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        text = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(self.scalar("<I"), self.scalar("<Q"))
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.scalar(fmt)

    def array(self, etype: int, count: int) -> list:
        if etype == _STRING:
            return self.string_array(count)
        if etype == _ARRAY:
            return [self.value(_ARRAY) for _ in range(count)]
        fmt = _SCALAR_FORMATS.get(etype)
        if fmt is None:
            raise ValueError(f"unknown metadata array element type {etype}")
        nbytes = count * struct.calcsize(fmt)
        self.need(nbytes)
        values = np.frombuffer(self.buf[self.pos : self.pos + nbytes], dtype=np.dtype(fmt)).tolist()
        self.pos += nbytes
        return values

    def string_array(self, count: int) -> list[str]:
        self.need(8 * count)
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise ValueError("truncated string array")
            out.append(buf[pos : pos + n].decode("utf-8"))
            pos += n
        self.pos = pos
        return out


# ---- config -----------------------------------------------------------------------------------


def build_hf_config(
    arch: str, meta: dict[str, Any], tensor_names: list[str], path: Path | str = "<gguf>"
) -> dict:
    """A transformers-style config.json dict for a supported GGUF architecture."""

    def key(name: str, default: Any = ...) -> Any:
        full = f"{arch}.{name}"
        if full in meta:
            return meta[full]
        if default is ...:
            raise ValueError(f"{path}: GGUF metadata lacks {full!r}")
        return default

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    kv_heads = _uniform(key("attention.head_count_kv", heads), "attention.head_count_kv", path)
    heads = _uniform(heads, "attention.head_count", path)
    head_dim = key("attention.key_length", None) or hidden // heads
    hf_arch, model_type = _HF_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _uniform(key("feed_forward_length"), "feed_forward_length", path),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": float(key("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10_000.0)),
        "rope_scaling": _rope_scaling(arch, meta),
        "max_position_embeddings": key("context_length"),
        "vocab_size": key("vocab_size", None) or len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        config.update(_gemma3_config(arch, meta, config))
    else:
        config["hidden_act"] = "silu"
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def _uniform(value: Any, name: str, path: Path | str) -> int:
    """A per-layer list that is the same everywhere collapses to one number."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ValueError(f"{path}: per-layer {name} values {sorted(set(value))} are not supported")
        return int(value[0])
    return int(value)


def _rope_scaling(arch: str, meta: dict[str, Any]) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _gemma3_config(arch: str, meta: dict[str, Any], config: dict) -> dict:
    """Gemma 3 facts llama.cpp hard-codes rather than stores (see its gemma3 hparams)."""
    layers = config["num_hidden_layers"]
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    # per-layer flags: true = sliding
    if isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern]
        pattern = None
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    # 27B scales queries by hidden/heads; every other size by 1/sqrt(head_dim)
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": 10_000.0,
        "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
        "sliding_window_pattern": pattern,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
        "attention_bias": False,
    }


# ---- tensors ----------------------------------------------------------------------------------


def _check_tensor_types(header: GGUFHeader) -> None:
    for info in header.tensors:
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
        except ValueError:
            qtype = None
        if qtype not in SUPPORTED_TENSOR_TYPES:
            label = qtype.name if qtype is not None else f"type id {info.ggml_type}"
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise ValueError(
                f"{header.path}: tensor {info.name!r} has unsupported quantization {label}; "
                f"supported: {supported}"
            )


def _check_tensor_bounds(header: GGUFHeader) -> None:
    size = header.path.stat().st_size
    for info in header.tensors:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        row = info.shape[-1] if info.shape else 1
        if row % block:
            raise ValueError(f"{header.path}: tensor {info.name!r} row of {row} is not a multiple of {block}")
        info.nbytes = int(np.prod(info.shape, dtype=np.int64)) // block * type_size
        if info.offset + info.nbytes > size:
            raise ValueError(f"{header.path}: truncated GGUF file, tensor {info.name!r} extends past the end")


def hf_tensor_name(arch: str, gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None if it has no counterpart."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS and suffix in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part, suffix = match.groups()
    table = _GEMMA3_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    if part not in table:
        return None
    return f"model.layers.{layer}.{table[part]}.{suffix}"


def load_gguf_tensor(
    path: str | Path, names: tuple[str, ...], keep_quantized: bool
) -> torch.Tensor | QuantWeight:
    """The first of `names` (HF names, e.g. "lm_head.weight") the GGUF file holds, read alone (as load_gguf reads
    it); ValueError if it holds none."""
    header = read_gguf_header(path)
    _check_tensor_types(header)
    _check_tensor_bounds(header)
    arch = header.metadata.get("general.architecture")
    config = build_hf_config(arch, header.metadata, [i.name for i in header.tensors], path=header.path)
    for name in names:
        tensors = _load_tensors(header, arch, config, keep_quantized, only=name)
        if tensors:
            return tensors[name]
    raise ValueError(f"{header.path}: no tensor {' or '.join(names)}")


def _load_tensors(
    header: GGUFHeader, arch: str, config: dict, keep_quantized: bool = False, only: str | None = None
) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor under its HF name (only: that one, if the file holds it)."""
    jobs = []
    for info in header.tensors:
        if info.name in _SKIPPED_TENSORS:
            warnings.warn(f"{header.path}: ignoring llama.cpp-only tensor {info.name}", stacklevel=3)
            continue
        name = hf_tensor_name(arch, info.name)
        if name is None:
            raise ValueError(f"{header.path}: unexpected tensor {info.name!r} for architecture {arch}")
        if only is None or name == only:
            jobs.append((name, info))
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    tensors = {}
    # a transient bar, drawn only when loading takes more than a second (a large model, or dequantising to float32)
    jobs = progress.bar(jobs, desc=f"loading {header.path.name}", unit="tensor", delay=1.0, leave=False)
    for name, info in jobs:
        qtype = GGMLQuantizationType(info.ggml_type)
        if keep_quantized and QuantWeight.supported(qtype.name, info.shape):
            rows = _undo_llama_cpp_layout(arch, info.name, _raw_rows(data, info), config)
            tensors[name] = QuantWeight.from_gguf(rows, qtype.name, info.shape)
            continue
        array = _undo_llama_cpp_layout(arch, info.name, _dequantize(data, info), config)
        tensors[name] = torch.from_numpy(array)
    return tensors


def _raw_rows(data: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes as [rows, bytes per row] (rows = the first dimension, blocks run along the last)."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    raw = np.asarray(data[info.offset : info.offset + info.nbytes])
    return raw.reshape(info.shape[0], info.shape[-1] // block * type_size)


def _dequantize(data: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    qtype = GGMLQuantizationType(info.ggml_type)
    block, type_size = GGML_QUANT_SIZES[qtype]
    row = info.shape[-1] if info.shape else 1
    raw = np.asarray(data[info.offset : info.offset + info.nbytes])
    raw = raw.reshape(*info.shape[:-1], row // block * type_size)
    array = dequantize(raw, qtype)
    # F32 comes back as a view of the memory map: copy it out.
    if qtype == GGMLQuantizationType.F32:
        array = array.copy()
    return np.ascontiguousarray(array, dtype=np.float32).reshape(info.shape)


def _undo_llama_cpp_layout(arch: str, gguf_name: str, array: np.ndarray, config: dict) -> np.ndarray:
    if arch == "llama":
        if ".attn_q." in gguf_name:
            return _unpermute_rotary(array, config["num_attention_heads"])
        if ".attn_k." in gguf_name:
            return _unpermute_rotary(array, config["num_key_value_heads"])
    # (never quantized)
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        # llama.cpp stores Gemma's (1 + w) norm scale
        return array - np.float32(1.0)
    return array


def _unpermute_rotary(array: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` for Q/K rows (interleaved -> half-split rotary layout)."""
    half = array.shape[0] // n_head // 2
    grouped = array.reshape(n_head, half, 2, *array.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(array.shape)
