"""load_gguf against transformers' own GGUF loader: tensors, config, tokenizer and chat template.

The real-model tests are slow (transformers takes ~30 s for SmolLM2 and ~60 s for Gemma 3 to load a
GGUF); the error-case and synthetic-file tests at the bottom are fast and need no model package.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from verispec.loader.gguf import load_gguf, read_gguf_header

TEXTS = [
    "Hello, world!",
    "",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nmultiple\r\nCRLF",
    "Numbers: 1234567890 3.14159 -42 1,000,000 2024-01-31",
    "Unicode: héllo wörld naïve café — “quotes” ‘single’ ½ ©",
    "中文字符和日本語のテキスト、한국어 Ελληνικά русский",
    "Emoji: 🙂🚀 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "Whitespace runs:     five spaces\t\t\ttabs   \n   end",
    "<|im_start|>user\nHi<|im_end|> <start_of_turn>model\n<end_of_turn>",
    "URL https://example.com/path?q=1&r=2 and e-mail a.b@c.org; don't can't we'll I'M",
    "\u00a0nbsp, zero\u200bwidth, combining e\u0301 and BOM \ufeff",
]

CHAT = [
    {"role": "user", "content": "Hi! What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And 3 + 3? Answer with émojis 🙂"},
]


def _hf_model(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )


def _hf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _rope_theta(config, layer_type: str = "full_attention") -> float:
    """transformers 5 keeps rope_theta in rope_parameters (per layer type for Gemma 3)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        return config.rope_theta
    if layer_type in params:
        params = params[layer_type]
    return params["rope_theta"]


def _assert_tensors_match(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], tied: bool) -> None:
    expected = set(theirs) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == theirs[name].shape, name
        assert torch.allclose(tensor, theirs[name].float(), atol=1e-6, rtol=0), name


COMMON_CONFIG_FIELDS = [
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
]


def _assert_config_matches(ours: dict, hf_model) -> None:
    config = hf_model.config
    assert ours["architectures"] == [type(hf_model).__name__]
    for name in COMMON_CONFIG_FIELDS:
        assert ours[name] == getattr(config, name), name
    assert ours["rope_theta"] == _rope_theta(config)


def _has_unicode_numeral(text: str) -> bool:
    return any(not c.isascii() and unicodedata.numeric(c, None) is not None for c in text)


def _assert_tokenizer_matches(ours, theirs, digit_split: bool = False) -> None:
    """Same ids and text as transformers' tokenizer.

    `digit_split`: the file's pre-tokenizer splits off every \\p{N} character (llama.cpp's "smollm",
    and SmolLM's own tokenizer.json), which transformers' GGUF conversion omits. Texts with non-ASCII
    numerals are then compared with transformers' vocabulary behind that pre-tokenizer instead.
    """
    reference = None
    if digit_split:
        reference = HFTokenizer.from_str(theirs.backend_tokenizer.to_str())
        reference.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    for text in TEXTS:
        ids = ours.encode(text)
        if reference is not None:
            assert ids == reference.encode(text).ids, text
        if reference is None or not _has_unicode_numeral(text):
            assert ids == theirs.encode(text), text
            assert ours.encode(text, add_special_tokens=False) == theirs.encode(
                text, add_special_tokens=False
            )
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.bos_token_id == theirs.bos_token_id
    assert theirs.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(theirs)


# ---- SmolLM2 (llama architecture, gpt2 BPE tokenizer, Q4_1/Q8_0/F32) ---------------------------


@pytest.fixture(scope="module")
def smollm2_hf_model(smollm2_gguf_file):
    return _hf_model(smollm2_gguf_file)


@pytest.fixture(scope="module")
def smollm2_hf_tokenizer(smollm2_gguf_file):
    return _hf_tokenizer(smollm2_gguf_file)


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2_checkpoint, smollm2_hf_model):
    tied = smollm2_checkpoint.hf_config["tie_word_embeddings"]
    _assert_tensors_match(smollm2_checkpoint.tensors, smollm2_hf_model.state_dict(), tied)


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2_checkpoint, smollm2_hf_model):
    config = smollm2_checkpoint.hf_config
    _assert_config_matches(config, smollm2_hf_model)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_scaling"] is None
    assert config["hidden_act"] == smollm2_hf_model.config.hidden_act
    assert config["attention_bias"] == smollm2_hf_model.config.attention_bias


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2_tokenizer, smollm2_hf_tokenizer):
    _assert_tokenizer_matches(smollm2_tokenizer, smollm2_hf_tokenizer, digit_split=True)
    # the file's eos (<|im_end|>) first, then llama.cpp's other end-of-generation token (<|endoftext|>)
    assert smollm2_tokenizer.eos_token_ids == [2, 0]
    assert not smollm2_tokenizer.add_bos_token


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2_checkpoint, smollm2_hf_tokenizer):
    tokenizer = smollm2_checkpoint.tokenizer
    assert smollm2_checkpoint.chat_template == smollm2_hf_tokenizer.chat_template
    for add_generation_prompt in (True, False):
        ours = tokenizer.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
        theirs = smollm2_hf_tokenizer.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
    with_system = [{"role": "system", "content": "Be brief."}, *CHAT[:2]]
    assert tokenizer.apply_chat_template(with_system) == smollm2_hf_tokenizer.apply_chat_template(
        with_system, tokenize=False, add_generation_prompt=True
    )


def test_smollm2_digits_split_like_llama_cpp(smollm2_tokenizer):
    # pre "smollm" splits every \p{N} character off (llama.cpp, and SmolLM's own tokenizer.json)
    ids = smollm2_tokenizer.encode("x 2024")
    assert [smollm2_tokenizer.decode([i]) for i in ids] == ["x", " ", "2", "0", "2", "4"]
    # transformers (plain GPT-2 regex) would merge " " with the first byte of "½" here
    assert smollm2_tokenizer.encode(" ½")[0] == smollm2_tokenizer.token_to_id("Ġ")


# ---- Gemma 3 270M (gemma3 architecture, sentencepiece vocabulary, Q4_K/Q5_0/Q6_K/Q8_0) ----------


@pytest.fixture(scope="module")
def gemma3_checkpoint(gemma3_gguf_file):
    return load_gguf(gemma3_gguf_file)


@pytest.fixture(scope="module")
def gemma3_hf_model(gemma3_gguf_file):
    return _hf_model(gemma3_gguf_file)


@pytest.fixture(scope="module")
def gemma3_hf_tokenizer(gemma3_gguf_file):
    return _hf_tokenizer(gemma3_gguf_file)


@pytest.mark.slow
def test_gemma3_tensors_match_transformers(gemma3_checkpoint, gemma3_hf_model):
    tied = gemma3_checkpoint.hf_config["tie_word_embeddings"]
    _assert_tensors_match(gemma3_checkpoint.tensors, gemma3_hf_model.state_dict(), tied)


@pytest.mark.slow
def test_gemma3_config_matches_transformers(gemma3_checkpoint, gemma3_hf_model):
    ours, theirs = gemma3_checkpoint.hf_config, gemma3_hf_model.config
    _assert_config_matches(ours, gemma3_hf_model)
    assert ours["architectures"] == ["Gemma3ForCausalLM"]
    assert ours["rope_local_base_freq"] == _rope_theta(theirs, "sliding_attention")
    for name in (
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "hidden_activation",
    ):
        assert ours[name] == getattr(theirs, name), name


@pytest.mark.slow
def test_gemma3_tokenizer_matches_transformers(gemma3_checkpoint, gemma3_hf_tokenizer):
    tokenizer = gemma3_checkpoint.tokenizer
    _assert_tokenizer_matches(tokenizer, gemma3_hf_tokenizer)
    assert tokenizer.add_bos_token and tokenizer.encode("hi")[0] == tokenizer.bos_token_id
    # <eos>, <end_of_turn>
    assert gemma3_checkpoint.eos_token_ids == [1, 106]


@pytest.mark.slow
def test_gemma3_chat_template(gemma3_checkpoint, gemma3_hf_tokenizer):
    # This GGUF carries no tokenizer.chat_template; both loaders must agree on that.
    assert gemma3_checkpoint.chat_template is None
    assert gemma3_hf_tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        gemma3_checkpoint.tokenizer.apply_chat_template(CHAT)


@pytest.mark.slow
def test_gemma3_greedy_matches_transformers(gemma3_gguf_file, gemma3_hf_model):
    """Our Gemma 3 runner (sliding + global layers, two RoPE bases, sandwich norms) generates what transformers does."""
    from verispec import LLM, SamplingParams

    llm = LLM(str(gemma3_gguf_file), max_model_len=256, max_num_seqs=2)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = gemma3_hf_model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[1, 106])
        assert ref[0, ids.shape[1] :].tolist() == out.outputs[0].token_ids, prompt


# ---- error cases --------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match="nope.gguf"):
        load_gguf(path)
    with pytest.raises(ValueError, match="not found"):
        load_gguf(str(path))


def test_directory_is_not_a_gguf(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_gguf(tmp_path)


def test_random_bytes(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="x.gguf"):
        load_gguf(path)


def test_empty_and_tiny_files(tmp_path):
    for size in (0, 3, 10):
        path = tmp_path / f"tiny{size}.gguf"
        path.write_bytes(b"GGUF"[:size] + b"\0" * max(0, size - 4))
        with pytest.raises(ValueError, match=f"tiny{size}.gguf"):
            load_gguf(path)


def test_garbage_after_magic(tmp_path):
    path = tmp_path / "garbage.gguf"
    rng = np.random.default_rng(1)
    path.write_bytes(b"GGUF" + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="garbage.gguf"):
        load_gguf(path)


@pytest.mark.parametrize("fraction", [0.0001, 0.001, 0.01, 0.5, 0.999])
def test_truncated_smollm2(tmp_path, smollm2_gguf_file, fraction):
    size = smollm2_gguf_file.stat().st_size
    keep = max(int(size * fraction), 64)
    path = tmp_path / "truncated.gguf"
    with smollm2_gguf_file.open("rb") as src:
        path.write_bytes(src.read(keep))
    with pytest.raises(ValueError, match="truncated.gguf"):
        load_gguf(path)


# ---- synthetic files: unsupported inputs, and the qwen2/qwen3 name maps --------------------------


def _byte_vocab() -> tuple[list[str], list[str]]:
    from verispec.tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    tokens = ["<|endoftext|>", "<|im_end|>", *chars, "he", "ll", "hell", "hello", "Ġw"]
    return tokens, merges


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], raw_types: dict | None = None) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    hidden, heads, kv_heads, layers = 32, 4, 2, 2
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(64)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "qwen3":
        # transformers ignores qwen3.attention.key_length and assumes Qwen3Config's 128, so use that
        writer.add_key_length(128)
        writer.add_value_length(128)
    tokens, merges = _byte_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, array in tensors.items():
        raw_type = (raw_types or {}).get(name)
        if raw_type is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _qwen_tensors(arch: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    hidden, head_dim = 32, 128 if arch == "qwen3" else 8
    q_out, kv_out = 4 * head_dim, 2 * head_dim
    vocab = len(_byte_vocab()[0])

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    out = {"token_embd.weight": w(vocab, hidden), "output_norm.weight": w(hidden)}
    for i in range(2):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": w(hidden),
            p + "ffn_norm.weight": w(hidden),
            p + "attn_q.weight": w(q_out, hidden),
            p + "attn_k.weight": w(kv_out, hidden),
            p + "attn_v.weight": w(kv_out, hidden),
            p + "attn_output.weight": w(hidden, q_out),
            p + "ffn_gate.weight": w(64, hidden),
            p + "ffn_up.weight": w(64, hidden),
            p + "ffn_down.weight": w(hidden, 64),
        }
        if arch == "qwen2":
            out |= {p + "attn_q.bias": w(q_out), p + "attn_k.bias": w(kv_out), p + "attn_v.bias": w(kv_out)}
        else:
            out |= {p + "attn_q_norm.weight": w(head_dim), p + "attn_k_norm.weight": w(head_dim)}
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_synthetic_qwen_matches_transformers(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    path = _write_gguf(tmp_path / f"{arch}.gguf", arch, _qwen_tensors(arch, np.random.default_rng(0)))
    checkpoint = load_gguf(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name)
    _assert_tensors_match(checkpoint.tensors, model.state_dict(), tied=True)
    config = checkpoint.hf_config
    assert config["architectures"] == [type(model).__name__]
    assert config["head_dim"] == (128 if arch == "qwen3" else 8)
    assert config["attention_bias"] == (arch == "qwen2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello world", "hello<|im_end|>hell o", "x\n\n 12 héllo"]:
        assert checkpoint.tokenizer.encode(text) == tokenizer.encode(text)
    assert checkpoint.tokenizer.encode("hello") == [len(_byte_vocab()[0]) - 2]


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_synthetic_quant_types_dequantize(tmp_path, qtype):
    gguf = pytest.importorskip("gguf")
    kind = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(2)
    tensors = _qwen_tensors("qwen3", rng)
    original = tensors["blk.0.ffn_up.weight"]
    quantized = gguf.quants.quantize(original, kind)
    tensors["blk.0.ffn_up.weight"] = quantized
    path = _write_gguf(tmp_path / "q.gguf", "qwen3", tensors, {"blk.0.ffn_up.weight": kind})
    loaded = load_gguf(path).tensors["model.layers.0.mlp.up_proj.weight"]
    expected = gguf.quants.dequantize(quantized, kind)
    assert loaded.shape == original.shape
    assert torch.equal(loaded, torch.from_numpy(expected.astype(np.float32)))
    assert torch.allclose(loaded, torch.from_numpy(original), atol=0.5)


def test_unsupported_architecture(tmp_path):
    path = _write_gguf(tmp_path / "phi.gguf", "phi3", _qwen_tensors("qwen2", np.random.default_rng(0)))
    with pytest.raises(ValueError, match=r"phi3.*llama, qwen2, qwen3, gemma3") as info:
        load_gguf(path)
    assert "phi.gguf" in str(info.value)


def test_unsupported_quant_type(tmp_path):
    gguf = pytest.importorskip("gguf")
    tensors = _qwen_tensors("qwen2", np.random.default_rng(0))
    kind = gguf.GGMLQuantizationType.IQ4_NL
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    tensors["blk.0.ffn_up.weight"] = np.zeros((64, 32 // block * type_size), dtype=np.uint8)
    path = _write_gguf(tmp_path / "iq.gguf", "qwen2", tensors, {"blk.0.ffn_up.weight": kind})
    with pytest.raises(ValueError, match=r"iq\.gguf.*blk\.0\.ffn_up\.weight.*IQ4_NL"):
        load_gguf(path)


def test_read_header_only(smollm2_gguf_file):
    header = read_gguf_header(smollm2_gguf_file)
    assert header.metadata["general.architecture"] == "llama"
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152
    embd = next(info for info in header.tensors if info.name == "token_embd.weight")
    assert embd.shape == (49152, 576)
