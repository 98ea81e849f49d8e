"""The servers the tests of `verispec serve` share: one plain and one n-gram speculating tiny server, started
once for the whole folder, and the offline reference they are compared with."""

from __future__ import annotations

import pytest

from tests.helpers import API_KEY, BODY_LIMIT, Server
from tests.tiny_models import write_tiny_checkpoint
from verispec import LLM


@pytest.fixture(scope="package")
def ckpt(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("server") / "llama", "llama"))


@pytest.fixture(scope="package")
def servers(ckpt, tmp_path_factory):
    """Both tiny servers, started in parallel: plain (config file + flag overrides, API key) and ngram."""
    d = tmp_path_factory.mktemp("serve")
    plain_cfg = d / "plain.yaml"
    plain_cfg.write_text(
        f"model: {ckpt}\nserved-model-name: tiny\nmax_model_len: 256\nmax-num-seqs: 4\n"
        f"api-key: {API_KEY}\ndisable-uvicorn-access-log: true\nmax-request-body-bytes: {BODY_LIMIT}\n"
    )
    # nested mapping for the speculative config; fixed K: the server's own planner times its steps for real (the
    # suite's frozen step cost is this process's), and on a random tiny model it would rightly verify little, while
    # these tests check what verified drafts report
    spec_cfg = d / "spec.yaml"
    spec_cfg.write_text(
        "served_model_name: [tiny, tiny-alias]\nmax-model-len: 256\nmax-num-seqs: 2\n"
        "max-queue: 1\nspeculative-config:\n  method: ngram\n  num_speculative_tokens: 3\n"
        "  prompt_lookup_max: 3\n  enable_adaptive_verification: false\nper-request-spec-decode-metrics: detailed\n"
    )
    plain = Server(["--config", str(plain_cfg), "--max-num-seqs", "8"], d / "plain.log")
    spec = Server([ckpt, "--config", str(spec_cfg)], d / "spec.log")
    try:
        yield {"plain": plain.wait_ready(), "spec": spec.wait_ready()}
    finally:
        plain.stop()
        spec.stop()


@pytest.fixture(scope="package")
def plain(servers) -> Server:
    return servers["plain"]


@pytest.fixture(scope="package")
def spec(servers) -> Server:
    return servers["spec"]


@pytest.fixture(scope="package")
def llm(ckpt) -> LLM:
    """The offline reference (no speculation)."""
    return LLM(ckpt, max_model_len=256, max_num_seqs=8)
