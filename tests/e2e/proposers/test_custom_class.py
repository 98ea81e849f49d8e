"""`method: "custom_class"`: a user's proposer class by import path (vLLM's plugin method) keeps greedy output equal
to plain decoding; a path that does not import, or a class that is not a Proposer, is a ValueError naming the key."""

from __future__ import annotations

import pytest

from tests.helpers import REPEATED_SPAN_PROMPTS
from verispec import LLM, SamplingParams
from verispec.proposers.base import Proposal, ProposerNeeds

SAMPLING = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PATH = "tests.custom_proposer.RepeatLastToken"
HERE = __name__


class NoPropose:
    """Has the bookkeeping methods but never drafts: not a Proposer."""

    needs = ProposerNeeds()

    def __init__(self, config, context):
        pass

    def add_request(self, req) -> None:
        pass

    def remove_request(self, req, aborted: bool) -> None:
        pass


class NoNeeds(NoPropose):
    """A proposer without its `needs` declaration."""

    needs = None

    def propose(self, reqs, k_max) -> Proposal:
        return Proposal([[] for _ in reqs])


class ReadsStatesWithoutObserving(NoNeeds):
    """Asks for the target's states but cannot take them."""

    needs = ProposerNeeds(target_hidden="last")


class NoArguments(NoNeeds):
    """Built without (config, context)."""

    needs = ProposerNeeds()

    def __init__(self):
        pass


NOT_A_CLASS = 3


def _plain(model: str) -> list[list[int]]:
    outs = LLM(model, max_model_len=256).generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "spec", [{"method": "custom_class", "model": PATH}, {"model": PATH.replace(".R", ":R")}]
)
def test_custom_proposer_keeps_greedy_output(tiny_llama, spec):
    """Every draft verified (fixed K): the drafts are often wrong, the output is still plain decoding's. Without
    `method`, an import path as `model` selects custom_class, as in vLLM."""
    cfg = {**spec, "num_speculative_tokens": 3, "enable_adaptive_verification": False}
    llm = LLM(tiny_llama, max_model_len=256, speculative_config=cfg)
    assert llm.engine.proposer.__class__.__name__ == "RepeatLastToken"
    outs = llm.generate(REPEATED_SPAN_PROMPTS, SAMPLING, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _plain(tiny_llama)
    spec_counts = llm.engine.counters.spec
    assert spec_counts.num_draft_tokens > 0


@pytest.mark.parametrize(
    "model, message",
    [
        ("tests.no_such_module.Drafter", "cannot import module 'tests.no_such_module'"),
        (f"{HERE}.Missing", "has no attribute 'Missing'"),
        (f"{HERE}.NOT_A_CLASS", r"is not a proposer class \(it is of type int\)"),
        (f"{HERE}.NoPropose", "is not a Proposer .*: no propose"),
        (f"{HERE}.NoNeeds", "`needs` must be a ProposerNeeds"),
        (f"{HERE}.ReadsStatesWithoutObserving", "make the engine call observe_hidden"),
        (f"{HERE}.NoArguments", r"built as cls\(config, context\)"),
    ],
)
def test_a_bad_class_is_a_value_error_naming_the_key(tiny_llama, model, message):
    cfg = {"method": "custom_class", "model": model, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=f"speculative_config.model '{model}'.*{message}"):
        LLM(tiny_llama, max_model_len=256, speculative_config=cfg)


def test_custom_class_needs_an_import_path(tiny_llama):
    cfg = {"method": "custom_class", "model": "/not/a/module", "num_speculative_tokens": 2}
    with pytest.raises(
        ValueError, match="method='custom_class' requires 'model' to contain the custom proposer"
    ):
        LLM(tiny_llama, max_model_len=256, speculative_config=cfg)
