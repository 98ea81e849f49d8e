"""Engine behaviour on tiny checkpoints: batching invariance, stop rules, logprobs, errors."""

from __future__ import annotations

import pytest

from tests import helpers
from verispec import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, max_model_len=256, max_num_seqs=16)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_batch_invariance(llm):
    prompts = helpers.random_prompts(16)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    batched = _ids(llm.generate(prompts, sp, use_tqdm=False))
    alone = [_ids(llm.generate(p, sp, use_tqdm=False))[0] for p in prompts]
    assert batched == alone


def test_seeded_sampling_batch_invariance(llm):
    prompts = helpers.random_prompts(16, seed=1)
    sps = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=100 + i, ignore_eos=True)
        for i in range(16)
    ]
    batched = _ids(llm.generate(prompts, sps, use_tqdm=False))
    alone = [_ids(llm.generate(p, s, use_tqdm=False))[0] for p, s in zip(prompts, sps)]
    assert batched == alone
    again = _ids(llm.generate(prompts, sps, use_tqdm=False))
    assert again == batched


def test_chunked_prefill_matches_one_pass(tiny_llama, llm):
    """Prompts longer than max_num_batched_tokens go in chunks (some steps need no logits at all): the same tokens
    as a one-pass prefill."""
    chunked = LLM(tiny_llama, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=16)
    prompts = helpers.random_prompts(6, seed=3) + [{"prompt_token_ids": list(range(5, 105))}]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert _ids(chunked.generate(prompts, sp, use_tqdm=False)) == _ids(
        llm.generate(prompts, sp, use_tqdm=False)
    )


@pytest.mark.parametrize(
    "spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}]
)
def test_a_long_prompt_does_not_stall_running_requests(tiny_llama, llm, spec):
    """A prompt prefilled in chunks while another request decodes: every chunk is followed by a decode step, so the
    running request keeps streaming; both outputs equal their runs alone."""
    engine = LLM(
        tiny_llama, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16, speculative_config=spec
    ).engine
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short, long = helpers.random_prompts(1, seed=8)[0]["prompt_token_ids"], list(range(5, 105))
    engine.add_request("a", None, short, sp)
    while engine.requests["a"].in_prefill or not engine.requests["a"].output_token_ids:
        engine.step()
    engine.add_request("b", None, long, sp)
    # per step: (tokens a has, b still in prefill)
    trace = []
    while engine.requests["b"].in_prefill:
        engine.step()
        trace.append((len(engine.requests["a"].output_token_ids), engine.requests["b"].in_prefill))
    grew = [n for (n, _), (m, _) in zip(trace, trace[1:]) if m > n]
    # 100 prompt tokens in chunks of 16: 7 chunks, a decode step after each of the first 6
    assert len(trace) >= 12 and len(grew) >= 6
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    alone = _ids(llm.generate([{"prompt_token_ids": short}, {"prompt_token_ids": long}], sp, use_tqdm=False))
    assert [outs["a"], outs["b"]] == alone


def test_more_requests_than_slots_are_queued(tiny_llama):
    small = LLM(tiny_llama, max_model_len=128, max_num_seqs=3)
    outs = small.generate(
        helpers.random_prompts(10, seed=2), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [5] * 10
    assert small.engine.cache.num_free == 3


def test_text_prompts_chat_and_order(llm):
    outs = llm.generate(
        ["def add(a, b):", "The quick brown fox"], SamplingParams(temperature=0, max_tokens=8)
    )
    assert [o.prompt for o in outs] == ["def add(a, b):", "The quick brown fox"]
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=4))
    assert chat[0].prompt.startswith("<|im_start|>user\nhello<|im_end|>")
    batch = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]])
    assert len(batch) == 2


def test_stop_rules(llm):
    p = helpers.random_prompts(1, seed=3)[0]
    free = llm.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    toks = free.outputs[0].token_ids
    stop_id = toks[5]
    out = llm.generate(
        p, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True)
    )[0]
    first = toks.index(stop_id)
    assert out.outputs[0].token_ids == toks[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id

    # the stop token's own text is left out unless include_stop_str_in_output (vLLM): the texts of plain runs
    # cut after j and j + 1 tokens, for a token whose text is not empty
    def cut(n: int) -> str:
        return (
            llm.generate(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].text
        )

    j = next(j for j in range(1, 30) if toks.index(toks[j]) == j and cut(j + 1) != cut(j))
    for include, n in ((False, j), (True, j + 1)):
        sp = SamplingParams(
            temperature=0,
            max_tokens=30,
            stop_token_ids=[toks[j]],
            ignore_eos=True,
            include_stop_str_in_output=include,
        )
        assert llm.generate(p, sp)[0].outputs[0].text == cut(n)
    text = free.outputs[0].text
    if len(text) > 12:
        stop = text[6:10]
        s = llm.generate(p, SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True))[0]
        assert s.outputs[0].text == text[: text.index(stop)]
        assert stop not in s.outputs[0].text and s.outputs[0].finish_reason == "stop"
    length = llm.generate(p, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(length.outputs[0].token_ids) == 7 and length.outputs[0].finish_reason == "length"


def test_logit_bias_and_allowed_token_ids(llm):
    p = helpers.random_prompts(1, seed=6)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    toks = llm.generate(p, greedy)[0].outputs[0].token_ids

    def run(**kw) -> list[int]:
        sp = SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True, **kw})
        return llm.generate(p, sp)[0].outputs[0].token_ids

    assert run(logit_bias={7: 100.0}) == [7] * 6
    assert run(logit_bias={toks[0]: -100.0})[0] != toks[0]
    assert run(logit_bias={toks[0]: 0.0}) == toks
    # the argmax, still allowed
    assert run(allowed_token_ids=[toks[0], 9])[0] == toks[0]
    allowed = {11, 12, 13}
    sampled = run(allowed_token_ids=sorted(allowed), temperature=1.0, seed=3, max_tokens=20)
    assert set(sampled) <= allowed and len(set(sampled)) > 1
    # bad_words beat a logit bias: 'a' (token 67) never comes; 'the' (86, 259): 259 never right after 86
    assert 67 not in run(logit_bias={67: 100.0}, bad_words=["a"])
    two = dict(allowed_token_ids=[86, 259], temperature=1.0, seed=1, max_tokens=20)
    free, banned = run(**two), run(**two, bad_words=["the"])
    # the test means something
    assert any(free[i : i + 2] == [86, 259] for i in range(19))
    assert not any(banned[i : i + 2] == [86, 259] for i in range(19)) and 86 in banned
    for kw, field in (
        ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ):
        with pytest.raises(ValueError, match=field):
            llm.generate(p, SamplingParams(**kw))
    for kw, field in (
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {1: "x"}}, "logit_bias"),
        ({"bad_words": "the"}, "bad_words"),
        ({"bad_words": [" "]}, "bad_words"),
    ):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    assert not llm.engine.has_unfinished()


def test_eos_and_min_tokens(llm):
    eos = llm.engine.eos_token_ids[0]
    # find a prompt whose greedy continuation hits EOS under a forced bias: use stop at EOS via stop_token_ids
    p = helpers.random_prompts(1, seed=4)[0]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=6, min_tokens=6, stop_token_ids=[eos]))[0]
    assert len(out.outputs[0].token_ids) == 6 and eos not in out.outputs[0].token_ids


def test_max_model_len_stops(tiny_llama):
    small = LLM(tiny_llama, max_model_len=32, max_num_seqs=2)
    out = small.generate(
        {"prompt_token_ids": list(range(5, 25))},
        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
    )[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32
    assert out.outputs[0].finish_reason == "length"


def test_logprobs_and_n(llm):
    p = helpers.random_prompts(1, seed=5)[0]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for tok, entry in zip(out.outputs[0].token_ids, lps):
        # greedy picks the top token
        assert tok in entry and entry[tok].rank == 1
        assert len(entry) >= 3
    multi = llm.generate(p, SamplingParams(temperature=1.0, n=3, max_tokens=5, seed=7, ignore_eos=True))[0]
    assert [c.index for c in multi.outputs] == [0, 1, 2] and len(
        {tuple(c.token_ids) for c in multi.outputs}
    ) > 1


def test_prompt_logprobs(tiny_llama, llm):
    """One entry per prompt token (None first), holding the prompt token with its rank: each equals the logprob a
    1-token generation from that prefix gives the token; the same in chunks; the generated tokens do not change."""
    p = helpers.random_prompts(1, seed=8)[0]
    ids = p["prompt_token_ids"]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2))[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    assert out.outputs[0].token_ids == llm.generate(p, greedy)[0].outputs[0].token_ids
    vocab = llm.engine.runner.model.cfg.vocab_size
    for i in (1, len(ids) // 2, len(ids) - 1):
        entry = plp[i]
        tok = ids[i]
        assert next(iter(entry)) == tok and 2 <= len(entry) <= 3
        one = SamplingParams(temperature=0, max_tokens=1, logprobs=vocab)
        ref = llm.generate({"prompt_token_ids": ids[:i]}, one)[0].outputs[0].logprobs[0]
        assert entry[tok].logprob == pytest.approx(ref[tok].logprob, abs=1e-5)
        assert entry[tok].rank == ref[tok].rank
    chunked = LLM(tiny_llama, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=4)
    again = chunked.generate(
        p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2)
    )[0]
    assert [
        None if e is None else {k: round(v.logprob, 4) for k, v in e.items()} for e in again.prompt_logprobs
    ] == [None if e is None else {k: round(v.logprob, 4) for k, v in e.items()} for e in plp]
    assert llm.generate(p, greedy)[0].prompt_logprobs is None


def test_skip_tokenizer_init(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, max_model_len=64)
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text prompt")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(device="tpu"), "device"),
        (dict(dtype="int3"), "dtype"),
        (dict(max_model_len=100_000), "max_model_len"),
        (dict(speculative_config={"method": "ngram", "bogus": 1}), "bogus"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 0}), "num_speculative_tokens"),
        (dict(speculative_config="{not json"), "JSON"),
        (
            dict(
                speculative_config={
                    "method": "ngram",
                    "num_speculative_tokens": 2,
                    "speculative_token_tree": "[(0,), (1,), (0, 0)]",
                }
            ),
            "speculative_token_tree",
        ),
        (
            dict(
                speculative_config={
                    "method": "ngram",
                    "num_speculative_tokens": 2,
                    "enable_block_verify": True,
                }
            ),
            "enable_block_verify",
        ),
        (
            dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "revision": "main"}),
            "revision",
        ),
    ],
)
def test_bad_engine_args(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, **kwargs)


@pytest.mark.parametrize("method", ["ngram_gpu"])
def test_methods_not_in_this_build_fail_clearly(tiny_llama, method):
    with pytest.raises(ValueError, match="not supported by this build"):
        LLM(
            tiny_llama,
            speculative_config={"method": method, "model": tiny_llama, "num_speculative_tokens": 2},
        )


def test_bad_requests(llm):
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate({"prompt_token_ids": [5] * 300})
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**6]})
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        llm.generate([{"foo": 1}])
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("hi", SamplingParams(logprobs=10**6))
    assert not llm.engine.has_unfinished()


def test_a_rejected_prompt_leaves_nothing_queued(llm):
    """A batch whose later prompt is refused by the engine: the earlier ones are withdrawn, not run later."""
    sp = SamplingParams(max_tokens=3, n=2, ignore_eos=True)
    for bad in ({"prompt_token_ids": [10**6]}, {"prompt_token_ids": [5] * 300}):
        with pytest.raises(ValueError):
            llm.generate(["fine", {"prompt_token_ids": [5, 6]}, bad], sp)
        assert not llm.engine.has_unfinished() and not llm.engine.requests
    before = llm.engine.counters.generation_tokens
    assert (
        len(llm.generate("fine", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2
    )
    assert llm.engine.counters.generation_tokens - before == 2


@pytest.mark.parametrize("bad", ["nope/missing", "/dev/null"])
def test_bad_model_paths(bad):
    with pytest.raises(ValueError):
        LLM(bad)


def test_corrupt_checkpoints(tiny_llama, tmp_path):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(tiny_llama, d)
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(d))
    (d / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(d))
    bad_gguf = tmp_path / "x.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ValueError):
        LLM(str(bad_gguf))


@pytest.mark.parametrize(
    "file, content, needle",
    [
        ("config.json", "[1, 2, 3]", "config.json: expected a JSON object"),
        (
            "tokenizer.json",
            '{"version": "1.0", "model": {"type": "Nope"}}',
            "tokenizer.json: not a valid tokenizer",
        ),
        ("tokenizer.json", '{"version": "1.0", "model": {', "tokenizer.json: not a valid tokenizer"),
        ("tokenizer_config.json", '{"bos_token": "<s>",,}', "tokenizer_config.json: not valid JSON"),
        ("model.safetensors.index.json", '{"weight_map": [1, 2]}', "'weight_map' must map tensor names"),
    ],
)
def test_malformed_checkpoint_files_name_the_file(tiny_llama, tmp_path, file, content, needle):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(tiny_llama, d)
    (d / file).write_text(content)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        LLM(str(d))


def test_untied_head_must_be_in_the_checkpoint(tiny_llama, tmp_path):
    """tie_word_embeddings false and no lm_head.weight: an error, not the embeddings silently used as the head."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "headless"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    assert not cfg.get("tie_word_embeddings", False)
    tensors = load_file(d / "model.safetensors")
    assert "lm_head.weight" in tensors
    del tensors["lm_head.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        LLM(str(d))


def test_generating_on_another_thread_warns_once(tiny_llama):
    """Two OpenMP thread pools (load on one thread, generate on another) make the CPU kernels slow: say so once."""
    import threading
    import warnings

    llm = LLM(tiny_llama, max_num_seqs=2, max_model_len=64, device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=2)
    caught: list[list[warnings.WarningMessage]] = []

    def work():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
        caught.append(w)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    msgs = [str(w.message) for w in caught[0] if "another thread" in str(w.message)]
    assert len(msgs) == 1 and "same thread" in msgs[0]
    with warnings.catch_warnings():
        # the loading thread: no warning
        warnings.simplefilter("error")
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)


def _spec_llm(tiny_llama: str, level: str) -> LLM:
    # fixed K: every step verifies its n-gram drafts, which the figures below then count
    spec = helpers.NGRAM | {"enable_adaptive_verification": False}
    return LLM(
        tiny_llama,
        max_model_len=256,
        max_num_seqs=4,
        speculative_config=spec,
        per_request_spec_decode_metrics=level,
    )


def test_per_request_spec_decode_metrics_on_outputs(tiny_llama):
    """per_request_spec_decode_metrics="detailed" (vLLM's setting): each finished CompletionOutput and its
    RequestOutput carry the request's SpecDecodeMetrics, whose figures agree with each other, with the output's
    draft counts and, summed, with the engine's spec-decode counters."""
    llm = _spec_llm(tiny_llama, "detailed")
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(helpers.prompts(3, seed=7), sp, use_tqdm=False)
    for o in outs:
        m = o.spec_decode_metrics
        assert m is o.outputs[0].spec_decode_metrics and m.detailed
        assert (m.num_draft_tokens, m.num_accepted_tokens) == (o.num_draft_tokens, o.num_accepted_tokens)
        assert m.num_spec_tokens == 3 and len(m.acceptance_histogram) == 4
        assert (
            m.num_spec_steps
            == sum(m.acceptance_histogram)
            == len(m.per_step_accepted)
            == len(m.per_step_drafted)
        )
        assert m.num_draft_tokens == sum(m.per_step_drafted) and m.num_accepted_tokens == sum(
            m.per_step_accepted
        )
        assert all(0 <= a <= d <= 3 for a, d in zip(m.per_step_accepted, m.per_step_drafted))
        assert {k: sum(row) for k, row in m.acceptance_histogram_by_draft_length.items()} == {
            k: m.per_step_drafted.count(k) for k in set(m.per_step_drafted)
        }
        assert m.mean_acceptance_length == pytest.approx(1 + m.num_accepted_tokens / max(m.num_spec_steps, 1))
        # every verify step commits its accepted drafts and one token of the target's
        assert m.num_spec_steps + m.num_accepted_tokens <= len(o.outputs[0].token_ids)
    stats = llm.engine.counters.spec
    assert sum(o.spec_decode_metrics.num_spec_steps for o in outs) == stats.num_drafts > 0
    assert sum(o.spec_decode_metrics.num_accepted_tokens for o in outs) == stats.num_accepted_tokens > 0
    # n > 1: each sample its own figures, the RequestOutput their sum
    two = llm.generate(
        helpers.prompts(1, seed=8), SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=20)
    )[0]
    parts = [c.spec_decode_metrics for c in two.outputs]
    assert two.spec_decode_metrics.num_spec_steps == sum(p.num_spec_steps for p in parts)
    assert two.spec_decode_metrics.per_step_drafted == parts[0].per_step_drafted + parts[1].per_step_drafted


def test_per_request_spec_decode_metrics_summary_and_none(tiny_llama):
    """summary: the counts and histograms, no per-step arrays; none (the default): nothing at all."""
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = helpers.prompts(2, seed=9)
    summary = _spec_llm(tiny_llama, "summary").generate(prompts, sp, use_tqdm=False)
    for o in summary:
        m = o.outputs[0].spec_decode_metrics
        assert not m.detailed and m.per_step_accepted == m.per_step_drafted == []
        assert m.num_spec_steps == sum(m.acceptance_histogram) and m.num_draft_tokens == o.num_draft_tokens
        assert "per_step_accepted" not in m.to_json()
    for o in _spec_llm(tiny_llama, "none").generate(prompts, sp, use_tqdm=False):
        assert o.spec_decode_metrics is None and o.outputs[0].spec_decode_metrics is None
        # the output's own draft counts stay
        assert o.num_draft_tokens > 0
    with pytest.raises(ValueError, match="requires speculative decoding"):
        LLM(tiny_llama, max_model_len=64, per_request_spec_decode_metrics="summary")


@pytest.mark.parametrize("activation_dtype", ["float32", "int8"])
def test_outputs_do_not_depend_on_the_thread_count(smollm2_gguf_file, activation_dtype, monkeypatch):
    """The thread governor (engine/threads.py) may run any step on one thread: every kernel gives the same bits
    with one thread as with two (prefill and decode, logprobs compared exactly)."""
    import torch

    from verispec.kernels.qweight import kernels_available

    if activation_dtype == "int8" and not kernels_available():
        pytest.skip("int8 activations need the native kernels")
    # the thread counts this test sets, not the governor's
    monkeypatch.setenv("VERISPEC_ADAPTIVE_THREADS", "0")
    llm = LLM(str(smollm2_gguf_file), max_model_len=512, activation_dtype=activation_dtype)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    prompts = ["def quicksort(arr):", "Write a haiku about the sea. " * 12]
    before = torch.get_num_threads()
    runs = []
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            outs = llm.generate(prompts, sp, use_tqdm=False)
            runs.append(
                [
                    (
                        o.outputs[0].token_ids,
                        [sorted((k, v.logprob) for k, v in lp.items()) for lp in o.outputs[0].logprobs],
                    )
                    for o in outs
                ]
            )
    finally:
        torch.set_num_threads(before)
    assert runs[0] == runs[1]
