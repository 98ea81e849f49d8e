"""Tiny random, seeded checkpoints in HF format (config.json + safetensors + tokenizer.json), written to tmp dirs.

Built with transformers so the parity tests compare against an independent implementation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5's chat template, tool parts (tools in the system turn, assistant tool_calls as <tool_call> blocks, tool
# results as <tool_response>), shortened
QWEN_TOOL_TEMPLATE = """{%- if tools %}
<|im_start|>system
You may call functions. Signatures within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return each call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())\n",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "héllo wörld — ünïcode ✓ 你好 🙂",
]

ARCH_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0, tie_word_embeddings=False
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1e6, tie_word_embeddings=True
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        rope_theta=1e6,
        tie_word_embeddings=True,
        head_dim=16,
    ),
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        rope_theta=1e6,
        rope_local_base_freq=10000.0,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        head_dim=16,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
    ),
}


def build_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    tok_cfg = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))


def build_sp_tokenizer(folder: Path, vocab: int) -> None:
    """A SentencePiece-style tokenizer (Llama 2 / Gemma kind: '▁' spaces, '<0x00>'..'<0xFF>' byte fallback, <unk>,
    <s> added first) trained on CORPUS, `vocab` ids in all: spellings, ids and merges differ from build_tokenizer's
    GPT-2 byte-level vocabulary, much of the text is shared (a cross-tokenizer draft's)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>", "<|im_end|>"]
    spaces = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = spaces
    tok.train_from_iterator(
        CORPUS * 4, trainers.BpeTrainer(vocab_size=vocab - 256, special_tokens=specials, show_progress=False)
    )
    trained = json.loads(tok.to_str())["model"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [p for p, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if p not in specials]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    model = models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True)
    out = Tokenizer(model)
    out.pre_tokenizer = spaces
    out.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    out.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    out.save(str(folder / "tokenizer.json"))
    tok_cfg = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))


def write_tiny_checkpoint(
    folder: Path,
    arch: str = "llama",
    seed: int = 0,
    num_layers: int = 3,
    shards: int = 1,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    tokenizer: str = "byte_level",
    vocab_size: int = VOCAB,
) -> Path:
    """Write a random seeded model of the given architecture to `folder` and return it. tokenizer: "byte_level"
    (build_tokenizer's, 312 tokens) or "sentencepiece" (build_sp_tokenizer's, vocab_size tokens)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer == "sentencepiece":
        build_sp_tokenizer(folder, vocab_size)
    else:
        build_tokenizer(folder)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=eos,
        dtype="float32",
    )
    cfg.update(ARCH_CONFIGS[arch])
    if arch == "gemma3":
        cfg["layer_types"] = [
            ("full_attention" if (i + 1) % 3 == 0 else "sliding_attention") for i in range(num_layers)
        ]
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # random init is tiny; widen it so logits are not all ~0 (makes parity meaningful)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if arch == "gemma3" else 1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="200KB" if shards > 1 else "5GB")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos], "bos_token_id": 0}))
    return folder


def write_tiny_medusa(
    folder: Path,
    target: Path,
    num_heads: int = 5,
    num_layers: int = 1,
    seed: int = 0,
    copy_head: bool = False,
) -> Path:
    """A Medusa checkpoint (vLLM's format) for the target at `target`: random seeded heads, or with copy_head the
    target's own LM head behind zero residual blocks (every head then drafts the target's next token again)."""
    from safetensors.torch import load_file, save_file

    tcfg = json.loads((target / "config.json").read_text())
    hidden, vocab = tcfg["hidden_size"], tcfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    if copy_head:
        weights = {}
        for f in sorted(target.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    for h in range(num_heads):
        for layer in range(num_layers):
            w = torch.zeros(hidden, hidden) if copy_head else torch.randn(hidden, hidden, generator=g) * 0.1
            tensors[f"medusa_heads.blocks.{h}.layers.{layer}.weight"] = w
        tensors[f"medusa_heads.lm_heads.{h}.weight"] = (
            head.clone() if copy_head else torch.randn(vocab, hidden, generator=g) * 0.3
        )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": hidden,
        "vocab_size": vocab,
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_tiny_mlp_speculator(
    folder: Path,
    target: Path,
    n_predict: int = 4,
    inner_dim: int = 48,
    seed: int = 0,
    tie_weights: bool = False,
    scale_input: bool = True,
) -> Path:
    """An MLP speculator checkpoint (vLLM / ibm-fms format) for the target at `target`, random seeded weights."""
    from safetensors.torch import save_file

    tcfg = json.loads((target / "config.json").read_text())
    emb_dim, vocab = tcfg["hidden_size"], tcfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    stages = 1 if tie_weights else n_predict
    tensors = {}
    for i in range(stages):
        tensors[f"speculator.emb.{i}.weight"] = torch.randn(vocab, inner_dim, generator=g) * 0.5
        tensors[f"speculator.head.{i}.weight"] = torch.randn(vocab, inner_dim, generator=g) * 0.3
        tensors[f"speculator.ln.{i}.weight"] = 1 + 0.1 * torch.randn(inner_dim, generator=g)
        tensors[f"speculator.ln.{i}.bias"] = 0.1 * torch.randn(inner_dim, generator=g)
    for i in range(2 if tie_weights else n_predict):
        tensors[f"speculator.proj.{i}.weight"] = (
            torch.randn(inner_dim, emb_dim if i == 0 else inner_dim, generator=g) * 0.2
        )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "model_type": "mlp_speculator",
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "vocab_size": vocab,
        "emb_dim": emb_dim,
        "inner_dim": inner_dim,
        "n_predict": n_predict,
        "tie_weights": tie_weights,
        "scale_input": scale_input,
        "top_k_tokens_per_head": [1] * n_predict,
        "n_candidates": 1,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_tiny_eagle(
    folder: Path,
    target: Path,
    num_layers: int = 1,
    seed: int = 0,
    copy_hidden: bool = False,
    fc_bias: bool = True,
) -> Path:
    """An EAGLE-1 draft (vLLM's format: `fc`, `layers.{i}.*` without layer 0's input norm) for the target at `target`:
    random seeded weights, or with copy_hidden an fc that passes the target state through and zero blocks (the draft
    then predicts exactly what the target predicted from that state: its newest token, again)."""
    from safetensors.torch import save_file

    tcfg = json.loads((target / "config.json").read_text())
    h, inter = tcfg["hidden_size"], tcfg["intermediate_size"]
    hd = tcfg.get("head_dim") or h // tcfg["num_attention_heads"]
    q, kv = tcfg["num_attention_heads"] * hd, tcfg["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.zeros(*shape) if copy_hidden else torch.randn(*shape, generator=g) * 0.08

    tensors = {"fc.weight": torch.cat([torch.zeros(h, h), torch.eye(h)], 1) if copy_hidden else rnd(h, 2 * h)}
    if fc_bias:
        tensors["fc.bias"] = rnd(h)
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes = {
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }
        for name, shape in shapes.items():
            tensors[p + name + ".weight"] = rnd(*shape)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
        if i > 0:
            tensors[p + "input_layernorm.weight"] = torch.ones(h)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {**tcfg, "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": num_layers}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_tiny_eagle3(
    folder: Path,
    target: Path,
    seed: int = 0,
    draft_vocab: int | None = None,
    copy_final: bool = False,
    layer_ids: list[int] | None = None,
) -> Path:
    """An EAGLE-3 draft (vLLM's format: `fc` [H, 3H], `midlayer.*` with q/k/v reading 2H, `norm`, `lm_head`, `d2t`)
    for the target at `target`: random seeded weights (draft_vocab: the first draft_vocab target ids, through d2t),
    or with copy_final an fc that keeps the third stream (the target's last layer output, layer_ids [0, 1, L]), zero
    blocks and the target's final norm and LM head (its drafts are then the target's own next tokens)."""
    from safetensors.torch import load_file, save_file

    tcfg = json.loads((target / "config.json").read_text())
    h, inter, vocab = tcfg["hidden_size"], tcfg["intermediate_size"], tcfg["vocab_size"]
    hd = tcfg.get("head_dim") or h // tcfg["num_attention_heads"]
    q, kv = tcfg["num_attention_heads"] * hd, tcfg["num_key_value_heads"] * hd
    dv = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.08):
        return torch.zeros(*shape) if copy_final else torch.randn(*shape, generator=g) * scale

    if copy_final:
        w = {}
        for f in sorted(target.glob("*.safetensors")):
            w.update(load_file(str(f)))
        fc = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], 1)
        norm, head = w["model.norm.weight"], w.get("lm_head.weight", w["model.embed_tokens.weight"])
    else:
        fc, norm, head = rnd(h, 3 * h), 1 + rnd(h, scale=0.1), rnd(dv, h, scale=0.3)
    tensors = {"fc.weight": fc, "norm.weight": norm.clone(), "lm_head.weight": head.clone()}
    shapes = {
        "self_attn.q_proj": (q, 2 * h),
        "self_attn.k_proj": (kv, 2 * h),
        "self_attn.v_proj": (kv, 2 * h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    for name, shape in shapes.items():
        tensors[f"midlayer.{name}.weight"] = rnd(*shape)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{name}.weight"] = torch.ones(h) if copy_final else 1 + rnd(h, scale=0.1)
    if dv != vocab:
        # draft id i is target id i
        tensors["d2t"] = torch.zeros(dv, dtype=torch.long)
        tensors["t2d"] = torch.arange(vocab) < dv
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        **tcfg,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": dv,
    }
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_tiny_dflash(
    folder: Path,
    target: Path,
    seed: int = 0,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int = VOCAB - 1,
    **config,
) -> Path:
    """A DFlash draft in z-lab's / vLLM's format (Qwen3 layers `layers.{i}.*` with q/k norms, `fc` [H, n H],
    `hidden_norm`, `norm`; no embedding or LM head: the target's) for the target at `target`, random seeded weights.
    config.json has `block_size`, `num_target_layers` and `dflash_config` {`mask_token_id`, `target_layer_ids`
    (default: the outputs of the target's first and last layers)}; `config` adds or overrides top-level keys."""
    from safetensors.torch import save_file

    tcfg = json.loads((target / "config.json").read_text())
    h, inter, vocab = tcfg["hidden_size"], tcfg["intermediate_size"], tcfg["vocab_size"]
    heads, kv_heads = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    hd = tcfg.get("head_dim") or h // heads
    ids = target_layer_ids if target_layer_ids is not None else [0, tcfg["num_hidden_layers"] - 1]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    tensors = {"fc.weight": rnd(h, len(ids) * h), "hidden_norm.weight": 1 + rnd(h), "norm.weight": 1 + rnd(h)}
    shapes = {
        "self_attn.q_proj": (heads * hd, h),
        "self_attn.k_proj": (kv_heads * hd, h),
        "self_attn.v_proj": (kv_heads * hd, h),
        "self_attn.o_proj": (h, heads * hd),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    for i in range(num_layers):
        for name, shape in shapes.items():
            tensors[f"layers.{i}.{name}.weight"] = rnd(*shape, scale=0.3)
        for name, dim in (("self_attn.q_norm", hd), ("self_attn.k_norm", hd)):
            tensors[f"layers.{i}.{name}.weight"] = 1 + rnd(dim)
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"layers.{i}.{name}.weight"] = 1 + rnd(h)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hd,
        "num_hidden_layers": num_layers,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "num_target_layers": tcfg["num_hidden_layers"],
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids},
        **config,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def write_tiny_mimo(folder: Path, seed: int = 0, pass_through: bool = False) -> Path:
    """A tiny MiMo target (`MiMoForCausalLM`: Qwen2 blocks) with one MTP layer (`model.mtp_layers.0.*`): random
    seeded, or with pass_through an MTP layer that hands the target's state to its LM head unchanged (input_proj
    keeps the state, zero block, hidden_layernorm 1 / w and final_layernorm w for the target's final norm weight w:
    RMS norms are scale-free, so the draft is the target's own prediction from that state)."""
    from safetensors.torch import load_file, save_file

    write_tiny_checkpoint(folder, "qwen2", seed=seed)
    w = {}
    for f in sorted(folder.glob("*.safetensors")):
        w.update(load_file(str(f)))
        f.unlink()
    cfg = json.loads((folder / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed + 1)

    def rnd(*shape):
        return torch.zeros(*shape) if pass_through else torch.randn(*shape, generator=g) * 0.08

    p, final = "model.mtp_layers.0.", w["model.norm.weight"]
    mtp = {
        "token_layernorm.weight": torch.ones(h),
        "hidden_layernorm.weight": 1 / final if pass_through else torch.ones(h),
        "input_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
        if pass_through
        else rnd(h, 2 * h),
        "final_layernorm.weight": final.clone() if pass_through else torch.ones(h),
        "input_layernorm.weight": torch.ones(h),
        "post_attention_layernorm.weight": torch.ones(h),
        "self_attn.q_proj.weight": rnd(q, h),
        "self_attn.k_proj.weight": rnd(kv, h),
        "self_attn.v_proj.weight": rnd(kv, h),
        "self_attn.q_proj.bias": rnd(q),
        "self_attn.k_proj.bias": rnd(kv),
        "self_attn.v_proj.bias": rnd(kv),
        "self_attn.o_proj.weight": rnd(h, q),
        "mlp.gate_proj.weight": rnd(inter, h),
        "mlp.up_proj.weight": rnd(inter, h),
        "mlp.down_proj.weight": rnd(h, inter),
    }
    save_file({**w, **{p + k: v.contiguous() for k, v in mtp.items()}}, str(folder / "model.safetensors"))
    config = {
        **cfg,
        "architectures": ["MiMoForCausalLM"],
        "model_type": "mimo",
        "num_nextn_predict_layers": 1,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_tiny_gguf(
    hf_folder: Path,
    path: Path,
    layer_type: str = "Q4_1",
    head_type: str = "Q8_0",
    v_type: str | None = None,
    embed_type: str | None = None,
) -> Path:
    """A llama-architecture GGUF of the HF checkpoint `hf_folder` (write_tiny_checkpoint's llama): projections in
    `layer_type` (the v projection in `v_type` if given: Q4_K_M files mix them so), the LM head in `head_type`
    (SmolLM2's mix by default; Q4_K and Q6_K need rows of whole 256-weight super-blocks), the embedding in `embed_type`
    (default float32), norms in float32, the tokenizer's vocabulary and merges. Q and K rows get llama.cpp's rotary permutation (the loader undoes it)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    from tests.quant_blocks import quantize_q4_k, quantize_q6_k

    cfg = json.loads((hf_folder / "config.json").read_text())
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    state = load_file(str(hf_folder / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [added.get(i, t) for t, i in vocab] + [f"<pad{i}>" for i in range(len(vocab), cfg["vocab_size"])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def add(name: str, w: np.ndarray, qtype: str | None = None) -> None:
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            w = np.ascontiguousarray(w, dtype=np.float32)
            own = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}.get(qtype)
            writer.add_tensor(name, own(w) if own else quantize(w, kind), raw_dtype=kind)

    add("token_embd.weight", state["model.embed_tokens.weight"], embed_type)
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"], head_type)
    parts = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg["num_hidden_layers"]):
        for g_name, hf_name in parts.items():
            w = state[f"model.layers.{i}.{hf_name}.weight"]
            if g_name in ("attn_q", "attn_k"):
                w = permute(w, heads if g_name == "attn_q" else kv_heads)
            qtype = v_type if g_name == "attn_v" and v_type else layer_type
            add(f"blk.{i}.{g_name}.weight", w, None if w.ndim == 1 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_renamed_vocab_copy(src: Path, folder: Path, seed: int = 0) -> Path:
    """A copy of the checkpoint at `src` whose token ids are shuffled: the tokenizer's ids and the rows of the
    embedding and LM head move together, so it is the same model under other ids (a cross-tokenizer draft that,
    mapped back, predicts exactly what `src` predicts)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    vocab = cfg["vocab_size"]
    # new id of old id i: perm[i]
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    inverse = torch.argsort(perm)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = tensors[name][inverse].contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    tok = json.loads((src / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {p: int(perm[i]) for p, i in tok["model"]["vocab"].items()}
    for added in tok["added_tokens"]:
        added["id"] = int(perm[added["id"]])
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text())
    eos = int(perm[cfg["eos_token_id"]])
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return folder


def write_sentencepiece_transplant(src: Path, folder: Path, vocab: int = 512, seed: int = 0) -> Path:
    """The checkpoint at `src` (build_tokenizer's byte-level vocabulary) with build_sp_tokenizer's vocabulary of
    `vocab` ids: each SentencePiece token that is one token of `src` (same text, or the same byte for a '<0xNN>'
    piece) gets that token's embedding and LM-head rows, the others random rows; the layers are `src`'s. A draft of
    another tokenizer that mostly predicts what `src` predicts."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    from verispec.tokenizer import bytes_to_unicode

    folder.mkdir(parents=True, exist_ok=True)
    build_sp_tokenizer(folder, vocab)
    sp = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bl = Tokenizer.from_file(str(src / "tokenizer.json"))
    specials = {t.content for t in sp.get_added_tokens_decoder().values()}
    # sentencepiece id -> the src id of the same text
    same = {}
    for piece, i in sp.get_vocab().items():
        if piece in specials:
            j = bl.token_to_id(piece)
        elif len(piece) == 6 and piece.startswith("<0x"):
            j = bl.token_to_id(bytes_to_unicode()[int(piece[3:5], 16)])
        else:
            ids = bl.encode(piece.replace("\u2581", " "), add_special_tokens=False).ids
            j = ids[0] if len(ids) == 1 else None
        if j is not None:
            same[i] = j
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    g = torch.Generator().manual_seed(seed)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            old = tensors[name]
            new = torch.randn(vocab, old.shape[1], generator=g) * 0.08
            new[list(same)] = old[list(same.values())]
            tensors[name] = new
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    eos = sp.token_to_id("<|im_end|>")
    (folder / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab, "eos_token_id": eos}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return folder


def write_parallel_eagle(source: Path, folder: Path, width: int, mask_token: int = 3, seed: int = 0) -> Path:
    """A P-EAGLE draft from an EAGLE / EAGLE-3 one at `source`: its weights, a random seeded `mask_hidden` of
    `width` floats in a second safetensors file ([1, 1, width], the speculators layout), and `mask_token_id` in its
    config.json."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(source, folder)
    g = torch.Generator().manual_seed(seed)
    save_file({"mask_hidden": torch.randn(1, 1, width, generator=g)}, str(folder / "mask.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "mask_token_id": mask_token}))
    return folder


def write_tiny_dspark(
    folder: Path,
    target: Path,
    seed: int = 0,
    markov_rank: int = 8,
    confidence: bool = True,
    with_markov: bool = True,
    block_size: int = 6,
    markov_scale: float = 3.0,
    **config,
) -> Path:
    """A DSpark draft (vLLM's Qwen3DSparkModel format) for the target at `target`: a tiny DFlash backbone, its
    settings at the top level of config.json (`block_size`, `mask_token_id`, `target_layer_ids`, `markov_rank`,
    `enable_confidence_head`, `confidence_head_with_markov`), and random seeded `markov_head.*` / `confidence_head.*`
    tensors in a second safetensors file (markov_scale: the bias strong enough to move argmaxes)."""
    from safetensors.torch import save_file

    write_tiny_dflash(folder, target, seed=seed, block_size=block_size)
    cfg = json.loads((folder / "config.json").read_text())
    inner = cfg.pop("dflash_config")
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    if markov_rank:
        tensors["markov_head.markov_w1.weight"] = torch.randn(vocab, markov_rank, generator=g)
        tensors["markov_head.markov_w2.weight"] = torch.randn(vocab, markov_rank, generator=g) * markov_scale
    if confidence:
        width = h + (markov_rank if with_markov else 0)
        tensors["confidence_head.proj.weight"] = torch.randn(1, width, generator=g) * 0.2
        tensors["confidence_head.proj.bias"] = torch.tensor([1.5])
    if tensors:
        save_file(tensors, str(folder / "heads.safetensors"))
    cfg |= {
        "architectures": ["Qwen3DSparkModel"],
        **inner,
        "markov_rank": markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": confidence,
        "confidence_head_with_markov": with_markov,
        **config,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
