"""The server's metrics (verispec/server/metrics.py exports them, /metrics is checked in test_app.py): vLLM's
periodic SpecDecoding line (verispec/metrics.py) lands in the server log."""

from __future__ import annotations

import time

from tests.helpers import PROMPTS


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
