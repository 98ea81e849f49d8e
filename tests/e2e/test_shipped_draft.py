"""The EAGLE-3 draft shipped for the embedded model (verispec/drafts): found without a path, by the alias or the
GGUF's own path, lossless, and accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verispec import LLM, SamplingParams
from verispec.drafts import SHIPPED

FOLDER = Path(__file__).parents[2] / "verispec" / "drafts" / SHIPPED[("smollm2-135m-instruct", "eagle3")]
CHATS = [
    [{"role": "user", "content": "Give me three tips for staying focused while studying."}],
    [{"role": "user", "content": "Explain what a hash map is in two sentences."}],
]


@pytest.fixture(scope="module")
def plain(smollm2_gguf_path):
    return LLM(smollm2_gguf_path, max_model_len=512, max_num_seqs=2)


@pytest.mark.slow
def test_the_shipped_eagle3_draft_needs_no_path_and_changes_nothing(plain, smollm2_gguf_path):
    sc = {"method": "eagle3", "num_speculative_tokens": 3}
    sp = SamplingParams(temperature=0, max_tokens=48)
    reference = [o.outputs[0].token_ids for o in plain.chat(CHATS, sp, use_tqdm=False)]
    # the GGUF's own path is the embedded model too
    spec = LLM(smollm2_gguf_path, max_model_len=512, max_num_seqs=2, speculative_config=sc)
    assert Path(spec.speculative_config.model) == FOLDER
    assert [o.outputs[0].token_ids for o in spec.chat(CHATS, sp, use_tqdm=False)] == reference
    stats = spec.engine.counters.spec
    assert stats.num_accepted_tokens > 0


def test_the_shipped_folder_records_how_it_was_made():
    report = json.loads((FOLDER / "training.json").read_text())
    assert report["positions"] > 0 and report["learning_curve"]
    assert (FOLDER / "model.gguf").stat().st_size < 20 * 2**20
