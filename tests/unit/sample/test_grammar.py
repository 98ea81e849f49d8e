"""Structured outputs' grammar layer (verispec/sample/grammar.py) on the tiny byte-level tokenizer: compiling and
its errors, drafts cut and forced, the masks of a step's verified positions, and applying them to logits."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_models import VOCAB, build_tokenizer
from verispec.kernels import ops
from verispec.sample.grammar import GrammarCompiler, masks, refused
from verispec.sampling_params import SamplingParams, StructuredOutputsParams
from verispec.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    return Tokenizer.from_hf_dir(folder)


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    # the model's vocabulary is wider than the tokenizer's: the extra ids are never allowed
    return GrammarCompiler(tok, VOCAB + 13, tok.eos_token_ids)


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    return set(torch.nonzero(~refused(bitmask_row[None], vocab)[0]).view(-1).tolist())


def test_a_schema_admits_its_json_and_cuts_a_draft_where_it_breaks(tok, compiler):
    g = compiler.matcher(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    good = tok.encode('{"color":"red","n":7}', add_special_tokens=False)
    assert g.valid_prefix(good) == len(good)
    bad = tok.encode('{"color":"blue"', add_special_tokens=False)
    n = g.valid_prefix(bad)
    assert 0 < n < len(bad) and tok.decode(bad[:n]) in '{"color":"b'
    # validating consumed nothing
    assert g.valid_prefix(good) == len(good)


def test_forced_tokens_spell_the_only_continuation(tok, compiler):
    g = compiler.matcher(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert tok.decode(g.forced([])) == '{"color":"'
    after = tok.encode('{"color":"gr', add_special_tokens=False)
    assert tok.decode(after + g.forced(after)).startswith('{"color":"green","n":')
    # forced() leaves the matcher where it was
    assert tok.decode(g.forced([])) == '{"color":"'


def test_step_masks_equal_masks_computed_token_by_token(tok, compiler):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    a, b = compiler.matcher(so), compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    drafts = [tok.encode('{"color":"red"', add_special_tokens=False), []]
    # [len + 1 + 1, W]
    step = masks([a, b], drafts)
    assert step.shape == (len(drafts[0]) + 2, (VOCAB + 13 + 31) // 32)
    ref = compiler.matcher(so)
    for j in range(len(drafts[0]) + 1):
        expect = masks([ref], [[]])[0]
        assert torch.equal(step[j], expect), j
        if j < len(drafts[0]):
            ref.accept([drafts[0][j]])
    allowed = _allowed(step[-1], VOCAB + 13)
    assert allowed and all(
        tok.decode([t]) in ("yes", "no")
        or "yes".startswith(tok.decode([t]))
        or "no".startswith(tok.decode([t]))
        for t in allowed
    )
    assert not any(t >= VOCAB for t in _allowed(step[0], VOCAB + 13))


def test_the_end_of_a_grammar_allows_only_eos(tok, compiler):
    g = compiler.matcher(StructuredOutputsParams(choice=["yes"]))
    g.accept(tok.encode("yes", add_special_tokens=False))
    assert _allowed(masks([g], [[]])[0], VOCAB + 13) == set(tok.eos_token_ids)
    # past the end (ignore_eos commits EOS again and again) nothing changes
    g.accept(tok.eos_token_ids[:1] * 3)


def test_bitmask_kernel_equals_the_unpacked_mask():
    gen = torch.Generator().manual_seed(0)
    v = 1000
    bm = torch.randint(-(2**31), 2**31 - 1, (3, (v + 31) // 32), generator=gen, dtype=torch.int32)
    bm[:, ::4] = 0
    bm[:, 1::5] = -1
    x = torch.randn(5, v, generator=gen)
    ref = x.clone()
    naive = torch.tensor([[not (int(bm[r, t // 32]) >> (t % 32)) & 1 for t in range(v)] for r in range(3)])
    assert torch.equal(refused(bm, v), naive)
    rows = [4, 0, 2]
    ref[rows] = ref[rows].masked_fill(naive, float("-inf"))
    if ops.apply_bitmask(x, bm, rows):
        assert torch.equal(x, ref)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "(["}, "structured_outputs.regex"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
        (
            {"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
            "structured_outputs.json",
        ),
    ],
)
def test_a_bad_constraint_is_a_value_error_naming_its_field(compiler, kw, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        compiler.matcher(StructuredOutputsParams(**kw))


def test_compiled_constraints_are_cached_and_matchers_are_not_shared(tok, compiler):
    so = StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    a, b = compiler.matcher(so), compiler.matcher(so)
    assert a.matcher is not b.matcher
    a.accept(tok.encode('{"co', add_special_tokens=False))
    assert tok.decode(b.forced([])) == '{"color":"'


@pytest.mark.parametrize(
    "kw, message",
    [
        ({}, "none are specified"),
        ({"json": SCHEMA, "regex": "a"}, "multiple are specified"),
        ({"choice": []}, "choice"),
        ({"choice": "a"}, "choice"),
        ({"structural_tag": 3}, "structural_tag"),
        ({"regex": 3}, "regex"),
        ({"json_object": True, "disable_any_whitespace": "yes"}, "disable_any_whitespace"),
    ],
)
def test_structured_outputs_params_say_what_is_wrong(kw, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kw)


def test_sampling_params_take_a_dict_and_name_unknown_keys():
    sp = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert sp.structured_outputs.kind == "choice"
    with pytest.raises(ValueError, match="unknown keys.*'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_a_structural_tag_leaves_text_free_and_constrains_each_tagged_segment(tok, compiler):
    tag = {
        "structures": [
            {
                "begin": "<function=get_weather>",
                "schema": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
                "end": "</function>",
            }
        ],
        "triggers": ["<function="],
    }
    g = compiler.matcher(StructuredOutputsParams(structural_tag=tag))
    good = tok.encode(
        'Sure. <function=get_weather>{"city": "Oslo"}</function> done', add_special_tokens=False
    )
    assert g.valid_prefix(good) == len(good)
    bad = tok.encode('Sure. <function=get_weather>{"town": 1}', add_special_tokens=False)
    assert tok.decode(bad[: g.valid_prefix(bad)]) == 'Sure. <function=get_weather>{"'
    with pytest.raises(ValueError, match=r"structural_tag.structures\[0\].begin"):
        compiler.matcher(StructuredOutputsParams(structural_tag={**tag, "triggers": ["<tool"]}))
