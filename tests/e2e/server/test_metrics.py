"""The server's metrics (verispec/server/metrics.py exports them, /metrics is checked in test_app.py): vLLM's
periodic SpecDecoding line (verispec/metrics.py) lands in the server log."""

from __future__ import annotations

import time

import httpx

from tests.helpers import API_KEY, PROMPTS


def test_spec_decode_log_line_in_server_log(spec):
    """vLLM's periodic 'SpecDecoding metrics' line (every 10 s while drafting) lands in the server log."""
    client = spec.client()
    deadline = time.monotonic() + 30
    while "SpecDecoding metrics:" not in spec.log.read_text() and time.monotonic() < deadline:
        client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
        )
        time.sleep(0.5)
    assert "SpecDecoding metrics: Mean acceptance length" in spec.log.read_text()


def _counter(text: str, name: str) -> float:
    """A counter's value for model tiny in a /metrics page."""
    for line in text.splitlines():
        if line.startswith(f'{name}_total{{model_name="tiny"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not exported")


def test_cache_salt_isolates_prefixes_and_the_counters_show_it(plain):
    """cache_salt in the body: the same prompt under another salt finds nothing cached, under its own salt every
    full block but the last; vLLM's prefix-cache counters and KV usage on /metrics; an empty salt is a 400."""
    client = plain.client()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    prompt = [int(t) for t in range(3, 70)]

    def hits() -> float:
        return _counter(httpx.get(f"{plain.url}/metrics", headers=headers).text, "vllm:prefix_cache_hits")

    def ask(salt: str) -> None:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt})

    ask("tenant-a")
    before = hits()
    ask("tenant-b")
    assert hits() == before
    ask("tenant-a")
    assert hits() == before + 64
    page = httpx.get(f"{plain.url}/metrics", headers=headers).text
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"}' in page
    assert _counter(page, "vllm:prefix_cache_queries") >= 3 * len(prompt)
    r = httpx.post(
        f"{plain.url}/v1/completions",
        headers=headers,
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "cache_salt": ""},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_drafts_a_grammar_cuts_and_forces_are_counted(spec):
    """A JSON schema under ngram: the grammar forces keys and punctuation (verified like any draft) and cuts
    drafts it refuses; both counters move on /metrics."""
    schema = {
        "type": "object",
        "properties": {
            "key": {"enum": ["alpha", "beta"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["key", "n"],
        "additionalProperties": False,
    }

    def counters() -> tuple[float, float]:
        page = httpx.get(f"{spec.url}/metrics").text
        return (
            _counter(page, "verispec:spec_decode_num_grammar_forced_draft_tokens"),
            _counter(page, "verispec:spec_decode_num_grammar_cut_draft_tokens"),
        )

    before = counters()
    client = spec.client()
    for prompt in PROMPTS[:3]:
        r = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
        )
        assert r.choices[0].text.startswith('{"key":"')
    forced, cut = counters()
    assert forced > before[0] and cut >= before[1]
