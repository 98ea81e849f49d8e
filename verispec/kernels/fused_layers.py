"""FusedLayers: a Llama-style decoder's layers run by one C call (layers.c) instead of ~30 PyTorch ops per layer.

Applies to models whose layers are plain pre-norm Llama blocks (Llama, SmolLM, Mistral without sliding layers,
Qwen2 with its qkv bias) with every projection kept quantized, on the CPU in float32: prompts (ragged rows stay
packed), decode steps, speculative verification, token trees. The C code calls the same kernels as the module
path in the same order, so the two are bitwise equal; anything else runs the modules.
"""

from __future__ import annotations

import ctypes

import torch

from verispec.kernels import ops
from verispec.kernels.build import INT8_ISAS, int8_isa, load_qgemm
from verispec.kernels.qweight import INT8_FMT_CODE

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
FMT_CODE = {
    "q4": 0,
    "q8": 1,
    "q4t": 2,
    "q8t": 3,
    "q4v": 4,
    "q8v": 5,
    "q6v": 6,
    "q6": 7,
    "q4kv": 8,
    "q6kv": 9,
    "q5v": 10,
}


class LayerDesc(ctypes.Structure):
    _fields_ = [
        ("w_qkv", _P),
        ("w_o", _P),
        ("w_gate_up", _P),
        ("w_down", _P),
        ("f_qkv", ctypes.c_int32),
        ("f_o", ctypes.c_int32),
        ("f_gate_up", ctypes.c_int32),
        ("f_down", ctypes.c_int32),
        ("b_qkv", _P),
        ("norm_in", _P),
        ("norm_post", _P),
        ("kv", _P),
        ("w_k", _P),
        ("w_v", _P),
        ("f_k", ctypes.c_int32),
        ("f_v", ctypes.c_int32),
    ]


class ModelDims(ctypes.Structure):
    _fields_ = [
        ("hidden", _I),
        ("hq", _I),
        ("hkv", _I),
        ("d", _I),
        ("inter", _I),
        ("cs", _I),
        ("ch", _I),
        ("ct", _I),
        ("eps", _F),
        ("scale", _F),
        ("softcap", _F),
        ("i8_isa", ctypes.c_int32),
        ("allreduce", _P),
        ("ar_ctx", _P),
        ("kv_dtype", ctypes.c_int32),
    ]


def why_not_fusable(model) -> str | None:
    """None if `model` (a DecoderLM) can run its layers through layers.c, else the reason it cannot."""
    cfg = model.cfg
    if load_qgemm() is None:
        return "no kernels"
    if cfg.is_gemma or cfg.qk_norm or not cfg.hidden_act.startswith("silu"):
        return "not a plain Llama block"
    if any(layer.sliding for layer in model.layers):
        return "sliding-window layers"
    if cfg.head_dim % 8 or cfg.hidden_size % 8 or cfg.head_dim > 1024:
        return "head_dim / hidden_size not multiples of 8"
    for layer in model.layers:
        at, mlp = layer.self_attn, layer.mlp
        dense = (at.qkv_proj, at.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(d.qweight is None for d in dense[1:]) or not at.qkv_proj.quantized:
            return "a projection is not quantized"
        parts = at.qkv_proj.qparts
        if parts is not None and [p.shape[0] for p in parts] != [at.hq * at.d, at.hkv * at.d, at.hkv * at.d]:
            return "qkv kept in parts other than q, k, v"
        if any(d.bias is not None for d in dense[1:]):
            return "bias outside qkv"
    norms = [
        w
        for layer in model.layers
        for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    ]
    if any(
        not (t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()) for t in [*norms, model.norm.weight]
    ):
        return "norm weights not CPU float32"
    if model.norm.eps != model.layers[0].input_layernorm.eps:
        return "the final norm's eps differs from the layers'"
    return None


class FusedLayers:
    def __init__(self, model):
        cfg = model.cfg
        self.n = len(model.layers)
        self.descs = (LayerDesc * self.n)()
        # the cache whose layer pointers are in descs
        self._kv: list[torch.Tensor] | None = None
        for desc, layer in zip(self.descs, model.layers):
            at, mlp = layer.self_attn, layer.mlp
            # q, k and v apart where their formats differ (w_qkv then holds q's rows)
            q, k, v = at.qkv_proj.qparts or (at.qkv_proj.qweight, None, None)
            for name, w in (("qkv", q), ("k", k), ("v", v), ("o", at.o_proj.qweight)):
                if w is not None:
                    setattr(desc, f"w_{name}", w._ptr)
                    setattr(desc, f"f_{name}", FMT_CODE[w.fmt])
            for name, dense in (("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
                setattr(desc, f"w_{name}", dense.qweight._ptr)
                setattr(desc, f"f_{name}", FMT_CODE[dense.qweight.fmt])
            desc.b_qkv = at.qkv_proj.bias.data_ptr() if at.qkv_proj.bias is not None else None
            desc.norm_in = layer.input_layernorm.weight.data_ptr()
            desc.norm_post = layer.post_attention_layernorm.weight.data_ptr()
        at = model.layers[0].self_attn
        self.dims = ModelDims(
            cfg.hidden_size,
            at.hq,
            at.hkv,
            at.d,
            cfg.intermediate_size,
            0,
            0,
            0,
            model.layers[0].input_layernorm.eps,
            at.scale,
            float(cfg.attn_logit_softcapping or 0.0),
            0,
        )
        if model.tp is not None:
            # the all-reduce the C layers call after attention and after the MLP
            self.dims.allreduce, self.dims.ar_ctx = model.tp.c_allreduce()
        fmts = {getattr(d, f"f_{n}") for d in self.descs for n in ("qkv", "k", "v", "o", "gate_up", "down")}
        if fmts & {FMT_CODE[f] for f in INT8_FMT_CODE}:
            # int8 activations: the same variant as the module path (QuantWeight.matmul) takes
            self.dims.i8_isa = INT8_ISAS[int8_isa()][0]
        # the final norm (its eps is the layers' own: why_not_fusable)
        self._final_norm = model.norm.weight.data_ptr()
        # keeps every pointer above alive
        self._model = model
        self._lib = load_qgemm()
        self._per_row = self._lib.decoder_scratch_per_row(ctypes.addressof(self.dims))
        # grown to the largest fused step seen (<= the KV budget), then reused
        self._scratch = torch.empty(0)
        # aux layer ids as asked -> (how many are in 0 .. num_layers, their C array, sorted and unique): made once,
        # since a step's ctypes objects cost tens of microseconds right after a forward, whose weights have streamed
        # through the caches
        self._aux: dict[tuple[int, ...], tuple[int, ctypes.Array]] = {}

    def _aux_ids(self, aux_layers: tuple[int, ...]) -> tuple[int, ctypes.Array]:
        got = self._aux.get(aux_layers)
        if got is None:
            ids = sorted({i for i in aux_layers if 0 <= i <= self.n})
            got = self._aux[aux_layers] = (len(ids), (ctypes.c_int64 * len(ids))(*ids))
        return got

    def applies(self, h: torch.Tensor, rope, ctx) -> bool:
        """Whether this step can run fused: inputs in the layouts layers.c reads.

        Like the module path, layers.c runs projections, norms and MLPs on the N packed tokens and only RoPE,
        the KV write and attention on the padded [S, Q] layout, so ragged rows (prompts of different lengths)
        cost no padded matmul rows."""
        cos, ssin = rope
        pos, mask = ctx.cache_pos, ctx.mask
        return (
            h.is_cpu
            and h.dtype is torch.float32
            and cos.is_contiguous()
            and ssin.is_contiguous()
            and pos.dtype is torch.int64
            and pos.is_contiguous()
            and ctx.blocks is not None
            and ctx.blocks.is_cpu
            and ctx.blocks.stride(-1) == 1
            and (mask is None or (mask.dtype is torch.bool and mask.stride(-1) == 1 and mask.shape[1] == 1))
        )

    def run(
        self,
        h: torch.Tensor,
        rope,
        ctx,
        kv: list[torch.Tensor],
        normed: torch.Tensor,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer on the packed tokens h [N, hidden] (contiguous; updated in place), then the model's final
        norm into normed [N, hidden] (contiguous). -> (normed, the streams entering aux_layers' layers in 0 ..
        num_layers side by side [N, n_aux * hidden] in increasing layer order, copied by the same call; None
        without any)."""
        # the engine's cache list (held here; its tensors never move): refresh on a new one
        if kv is not self._kv:
            for desc, t in zip(self.descs, kv):
                desc.kv = t.data_ptr()
            self.dims.cs, self.dims.ch, self.dims.ct = kv[0].stride()[:3]
            self.dims.kv_dtype = ops.kv_dtype_code(kv[0])
            self._kv = kv
        cos, ssin = rope
        s, q = ctx.cache_pos.shape
        if self._scratch.numel() < s * q * self._per_row:
            self._scratch = torch.empty(s * q * self._per_row)
        # [N] int64 padded position of each packed token, or None (no padding)
        pack = ctx.pack
        mask = ctx.mask
        m_ptr, ms, mq = (
            (mask.data_ptr(), mask.stride(0), mask.stride(2)) if mask is not None else (None, 0, 0)
        )
        if mask is not None and mask.shape[0] == 1:
            ms = 0
        n_aux, at = self._aux_ids(aux_layers) if aux_layers else (0, None)
        # [N, n_aux * hidden]
        side = h.new_empty(h.shape[0], n_aux * h.shape[1]) if n_aux else None
        self._lib.decoder_layers_f32(
            ctypes.addressof(self.descs),
            self.n,
            ctypes.addressof(self.dims),
            h.data_ptr(),
            s,
            q,
            pack.data_ptr() if pack is not None else None,
            # [S] int64 real rows per sequence, or None (no padding): the padding is not computed
            ctx.qlen.data_ptr() if ctx.qlen is not None else None,
            h.shape[0],
            cos.data_ptr(),
            ssin.data_ptr(),
            ctx.blocks.data_ptr(),
            ctx.blocks.stride(0),
            ctx.block_shift,
            ctx.cache_pos.data_ptr(),
            ctx.kv_len,
            m_ptr,
            ms,
            mq,
            self._scratch.data_ptr(),
            torch.get_num_threads(),
            at if n_aux else None,
            n_aux,
            side.data_ptr() if n_aux else None,
            self._final_norm,
            normed.data_ptr(),
        )
        return normed, side
