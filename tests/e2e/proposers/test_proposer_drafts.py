"""What the stateful proposers draft, not only that verification keeps the output: every draft of a chain equals the
drafter run from scratch on the committed tokens (its own KV cache, catch-up and rollback leave no trace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.eagle3_reference import eagle3_reference
from verispec import LLM, SamplingParams


@pytest.mark.parametrize("skip", [False, True])
def test_eagle3_chain_equals_the_block_recomputed_from_scratch(tiny_llama, tiny_eagle3, skip):
    """The proposer catches up on the committed (token, target state) pairs, then feeds back its own drafts and
    states with its KV cache: each draft must be the argmax of the block run from scratch on entries
    (x_1, h_0), ..., (x_n, h_{n-1}), (d_1, fed back), ..., (d_{k-1}, fed back) at positions 0, 1, 2, ... A feedback
    entry one position off (a skipped or stale KV entry), a stale catch-up entry or a misaligned state gives other
    logits. skip: each request is asked for drafts only every other step; the drafter runs only the requests asked
    (one skipped keeps its states unread) and later catches up over several steps' states at once."""
    folder = Path(tiny_eagle3)
    w, cfg = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    llm = LLM(
        tiny_llama,
        # the reference runs in float32 on the CPU (CUDA would run the draft in bfloat16)
        device="cpu",
        max_model_len=256,
        max_num_seqs=4,
        # prompts in chunks: the states arrive over several forwards
        max_num_batched_tokens=16,
        speculative_config={"method": "eagle3", "model": tiny_eagle3, "num_speculative_tokens": 4},
    )
    prop = llm.engine.proposer
    states: dict[str, list[torch.Tensor]] = {}
    calls = []
    observe, propose = prop.observe_hidden, prop.propose

    def spy_observe(reqs, hidden):
        for r, h in zip(reqs, hidden):
            states.setdefault(r.request_id, []).append(h.clone())
        observe(reqs, hidden)

    def spy_propose(reqs, k_max):
        if skip:
            k_max = [k if (len(calls) + i) % 2 else 0 for i, k in enumerate(k_max)]
        before = dict(prop.computed)
        out = propose(reqs, k_max)
        for r, k in zip(reqs, k_max):
            if k == 0:
                # not read: its states wait for its next draft
                assert prop.computed[r.request_id] == before[r.request_id]
            # the planner prices the positions a draft would read first
            assert prop.backlog(r) == (r.num_computed - before[r.request_id] if k == 0 else 0)
        for r, drafts in zip(reqs, out.token_ids):
            h = torch.cat(states[r.request_id])[: r.num_computed]
            calls.append((r.tokens_from(0), h, drafts))
        return out

    prop.observe_hidden, prop.propose = spy_observe, spy_propose
    prompts = [{"prompt_token_ids": list(range(5, 40))}, {"prompt_token_ids": [9, 10, 11, 9, 10, 11, 12]}]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    checked = 0
    for tokens, h, drafts in calls:
        # the newest token x_n: its target state is not computed yet
        n = len(tokens) - 1
        assert h.shape[0] == n
        if not drafts:
            continue
        # entry p reads x_{p+1}; the feedback entries read d_1 .. d_{k-1}
        ids = tokens[1:] + drafts[:-1]
        with torch.no_grad():
            embeds = prop.draft.embed(torch.tensor(ids))
            head_in, _ = eagle3_reference(w, cfg, embeds, [*h, *[None] * (len(drafts) - 1)])
        # [k, draft vocab]: drafts 1..k
        logits = head_in[n - 1 :] @ w["lm_head.weight"].T
        for d, row in zip(drafts, logits):
            # the argmax (up to float ties)
            assert d < row.shape[0] and row[d] >= row.max() - 1e-4
            checked += 1
    assert checked > 20


def test_draft_model_chain_is_the_draft_models_own_greedy_continuation(tiny_llama, tiny_draft):
    """draft_model keeps its own KV cache across steps (catch-up on accepted tokens, rollback of rejected ones): its
    drafts must be exactly the draft model's greedy continuation of the committed tokens, as plain decoding with the
    draft model gives it."""
    llm = LLM(
        tiny_llama,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        speculative_config={"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 4},
    )
    calls, propose = [], llm.engine.proposer.propose

    def spy_propose(reqs, k_max):
        out = propose(reqs, k_max)
        calls.extend((r.tokens_from(0), drafts) for r, drafts in zip(reqs, out.token_ids) if drafts)
        return out

    llm.engine.proposer.propose = spy_propose
    prompts = [{"prompt_token_ids": list(range(5, 40))}, {"prompt_token_ids": [9, 10, 11, 9, 10, 11, 12]}]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    draft = LLM(tiny_draft, max_model_len=256, max_num_seqs=4)
    expected = draft.generate(
        [{"prompt_token_ids": t} for t, _ in calls],
        [SamplingParams(temperature=0, max_tokens=len(d), ignore_eos=True) for _, d in calls],
        use_tqdm=False,
    )
    assert len(calls) > 5
    assert [d for _, d in calls] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("draft_name, least", [("tiny_draft", 2), ("tiny_llama", 6)])
def test_draft_model_hindsight_picks_are_its_greedy_choice_for_the_newest_token(
    tiny_llama, draft_name, least, request
):
    """The catch-up also scores the row before each request's newest committed token: the pick it reports there
    (which the planner judges in hindsight) must be the draft model's own greedy choice for that token from the
    context before it, as plain decoding with the draft model gives it. A weak draft (its drafts rejected) makes
    picks at each prompt's catch-up; the target as its own draft (every draft accepted) at every step."""
    tiny_draft = request.getfixturevalue(draft_name)
    llm = LLM(
        tiny_llama,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        speculative_config={"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 4},
    )
    calls, propose = [], llm.engine.proposer.propose

    def spy_propose(reqs, k_max):
        out = propose(reqs, k_max)
        picks = out.hindsight or [None] * len(reqs)
        calls.extend((r.tokens_from(0)[:-1], p[0]) for r, p in zip(reqs, picks) if p is not None)
        return out

    llm.engine.proposer.propose = spy_propose
    prompts = [{"prompt_token_ids": list(range(5, 40))}, {"prompt_token_ids": [9, 10, 11, 9, 10, 11, 12]}]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    draft = LLM(tiny_draft, max_model_len=256, max_num_seqs=4)
    expected = draft.generate(
        [{"prompt_token_ids": t} for t, _ in calls],
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(calls) >= least
    assert [p for _, p in calls] == [o.outputs[0].token_ids[0] for o in expected]


def test_eagle3_draft_follows_a_quantized_targets_weights(tiny_llama, tiny_eagle3, monkeypatch):
    """With a target kept on quantized blocks the draft's float layers become Q8_0 blocks too; the drafts change a
    little (they are a quantized draft's), the output does not."""
    from verispec.kernels.qweight import kernels_available
    from verispec.layers import linear
    from verispec.proposers import factory

    if not kernels_available():
        pytest.skip("no native kernels on this machine")
    # the tiny target is float32
    for module in (linear, factory):
        monkeypatch.setattr(module, "keeps_quantized", lambda module: True)
    spec = {"method": "eagle3", "model": tiny_eagle3, "num_speculative_tokens": 3}
    # quantized blocks run on the CPU's kernels (CUDA dequantizes every weight to bfloat16)
    kw = dict(device="cpu", max_model_len=256, max_num_seqs=4)
    llm = LLM(tiny_llama, speculative_config=spec, **kw)
    draft = llm.engine.proposer.draft
    assert draft.fc.qweight is not None and draft.mlp.down_proj.qweight is not None
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 40))}, {"prompt_token_ids": [9, 10, 11, 9, 10, 11, 12]}]
    plain = LLM(tiny_llama, **kw).generate(prompts, sp, use_tqdm=False)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.counters.spec.num_draft_tokens > 0


@pytest.mark.parametrize("skip", [False, True])
def test_dflash_block_equals_the_block_recomputed_from_scratch(tiny_llama, tiny_dflash, skip):
    """The proposer writes the context K/V of the target states as they arrive (prompt chunks, accepted drafts) and
    overwrites its block's K/V the next step: each step's drafts must be the argmax of the DFlash formula run from
    scratch on all the target's states so far and the block [newest token, mask, ..., mask]. A context position
    skipped, written twice or one off, or a stale block entry, gives other logits. skip: each request is asked
    every other step (one not asked keeps its states unwritten until it is)."""
    from tests.dflash_reference import dflash_reference

    folder = Path(tiny_dflash)
    w, cfg = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    target = load_file(str(Path(tiny_llama) / "model.safetensors"))
    embed, head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    mask = cfg["dflash_config"]["mask_token_id"]
    llm = LLM(
        tiny_llama,
        # the reference runs in float32 on the CPU (CUDA would run the draft in bfloat16)
        device="cpu",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        speculative_config={"method": "dflash", "model": tiny_dflash, "num_speculative_tokens": 4},
    )
    prop = llm.engine.proposer
    states: dict[str, list[torch.Tensor]] = {}
    calls = []
    observe, propose = prop.observe_hidden, prop.propose

    def spy_observe(reqs, hidden):
        for r, h in zip(reqs, hidden):
            states.setdefault(r.request_id, []).append(h.clone())
        observe(reqs, hidden)

    def spy_propose(reqs, k_max):
        if skip:
            k_max = [k if (len(calls) + i) % 2 else 0 for i, k in enumerate(k_max)]
        before = dict(prop.computed)
        out = propose(reqs, k_max)
        for r, k in zip(reqs, k_max):
            if k == 0:
                # not read: its states wait for its next draft
                assert prop.computed[r.request_id] == before[r.request_id]
            # the planner prices the positions a draft would read first
            assert prop.backlog(r) == (r.num_computed - before[r.request_id] if k == 0 else 0)
        for r, drafts in zip(reqs, out.token_ids):
            calls.append((r.tokens_from(0), torch.cat(states[r.request_id])[: r.num_computed], drafts))
        return out

    prop.observe_hidden, prop.propose = spy_observe, spy_propose
    prompts = [{"prompt_token_ids": list(range(5, 40))}, {"prompt_token_ids": [9, 10, 11, 9, 10, 11, 12]}]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    checked = 0
    for tokens, h, drafts in calls:
        # the states of every position before the newest token, each the target's two streams
        assert h.shape == (len(tokens) - 1, 2 * 64)
        if not drafts:
            continue
        block = torch.tensor([tokens[-1]] + [mask] * len(drafts))
        with torch.no_grad():
            out = dflash_reference(w, cfg, h, embed[block])
        # [k, V]: the mask positions
        logits = out[1:] @ head.T
        for d, row in zip(drafts, logits):
            # the argmax (up to float ties)
            assert row[d] >= row.max() - 1e-4
            checked += 1
    assert checked > 20
