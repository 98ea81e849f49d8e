"""IncrementalDetokenizer: token-by-token text deltas equal a full decode and never split a character."""

from __future__ import annotations

import random
import re

import jinja2
import pytest

from verispec.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world! Plain ASCII first.",
    "héllo wörld — naïve café, “quotes” and ½ ©",
    "中文字符和日本語のテキスト、한국어",
    "Emoji: 🙂🚀 👨‍👩‍👧‍👦 family, 🇫🇷 flag, ❤️ heart",
    "Math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√ and combining e\u0301 a\u0308",
    "mixed 🙂x🙂y 你a好b 𝔘z",
    "  spaces   and\ttabs\n\nnew lines  ",
]


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3_gguf_file) -> Tokenizer:
    from verispec.loader.gguf import read_gguf_header

    header = read_gguf_header(gemma3_gguf_file)
    return Tokenizer.from_gguf_fields(header.metadata, header.metadata["general.architecture"])


@pytest.fixture(params=["smollm2", "gemma3"])
def tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tokenizer")


def _feed_one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add_tokens([token_id]) for token_id in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[])
    deltas = _feed_one_by_one(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.text == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert detok.output_ids == ids


def test_multibyte_characters_are_held_back(smollm2_tokenizer):
    # With a byte-level vocabulary a rare character spans several tokens: the first ones emit nothing.
    text = "𝔘🙂"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in smollm2_tokenizer.decode([i]) for i in ids), "expected split characters"
    deltas = _feed_one_by_one(IncrementalDetokenizer(smollm2_tokenizer), ids)
    assert "" in deltas
    assert [d for d in deltas if d] == ["𝔘", "🙂"]


def test_with_prompt_context(tokenizer):
    prompt = tokenizer.encode("Question: what is this?\nAnswer:", add_special_tokens=True)
    answer = " It is ünïcode 🙂 — 你好 𝔘 and more text."
    ids = tokenizer.encode(answer, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    deltas = _feed_one_by_one(detok, ids)
    full = tokenizer.decode(prompt + ids)
    assert full.endswith(detok.text)
    assert detok.text == full[len(tokenizer.decode(prompt)) :]
    assert detok.text == answer
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("seed", range(5))
def test_chunked_feeding_matches(tokenizer, seed):
    rng = random.Random(seed)
    text = "".join(TEXTS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pos, deltas = 0, []
    while pos < len(ids):
        # speculative decoding accepts several tokens at once
        step = rng.randint(1, 6)
        deltas.append(detok.add_tokens(ids[pos : pos + step]))
        pos += step
    assert "".join(deltas) == detok.text == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(smollm2_tokenizer):
    tok = smollm2_tokenizer
    end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("Done 🙂", add_special_tokens=False) + [end]
    skipped = IncrementalDetokenizer(tok, skip_special_tokens=True)
    skipped.add_tokens(ids)
    assert skipped.text == "Done 🙂"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    _feed_one_by_one(kept, ids)
    assert kept.text == "Done 🙂<|im_end|>"


def test_flush_emits_incomplete_tail(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("ok 𝔘", add_special_tokens=False)
    # cut the rare character's bytes short, so the decoded tail is an incomplete UTF-8 sequence
    cut = next(i for i in range(len(ids) - 1, 0, -1) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    held = detok.add_tokens(ids[:cut])
    assert "\ufffd" not in held and held.startswith("ok")
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert detok.text == held + tail == tok.decode(ids[:cut])
    assert detok.flush() == ""


def test_decode_window_stays_small(smollm2_tokenizer):
    """Each step decodes a few recent tokens, not the whole output."""
    calls: list[int] = []

    class Recording(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            ids = list(ids)
            calls.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    tok = smollm2_tokenizer
    recording = Recording(tok.backend, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids)
    text = " ".join(TEXTS) * 20
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("A long prompt " * 50, add_special_tokens=False)
    detok = IncrementalDetokenizer(recording, prompt_ids=prompt)
    _feed_one_by_one(detok, ids)
    assert detok.text == text
    assert len(ids) > 1000
    assert max(calls) <= 12


def test_from_hf_dir_round_trip(tmp_path, smollm2_tokenizer):
    """A tokenizer.json + tokenizer_config.json + generation_config.json folder loads equivalently."""
    import json

    tok = smollm2_tokenizer
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": tok.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.bos_token_id == 1 and loaded.eos_token_ids == [2, 0]
    assert not loaded.add_bos_token
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")


def test_chat_template_sandbox_helpers(smollm2_tokenizer):
    template = (
        "{% generation %}{{ messages[0] | tojson }}{% endgeneration %}"
        "{% if strftime_now('%Y') | length != 4 %}{{ raise_exception('bad year') }}{% endif %}"
        "{% if bos_token %}{{ raise_exception('no ' + bos_token) }}{% endif %}"
    )
    tok = Tokenizer(smollm2_tokenizer.backend, chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '{"role": "user", "content": "é"}'
    tok.bos_token_id = 1
    with pytest.raises(jinja2.TemplateError, match=re.escape("no <|im_start|>")):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
