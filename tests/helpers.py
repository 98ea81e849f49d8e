"""What test files share: prompts, the checks several files run, and the launcher of a real `verispec serve`
process. Test files import from here (or from the builders in tiny_models.py / quant_blocks.py and the references
in eagle3_reference.py / dflash_reference.py), never from each other."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch

from verispec import LLM, SamplingParams
from verispec.audit import chi2_pvalue, second_token_law
from verispec.config import ModelConfig

if TYPE_CHECKING:
    import openai

ROOT = Path(__file__).resolve().parents[1]
# the architectures of the tiny checkpoints (tests/conftest.py: tiny_checkpoints)
ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# ---------------------------------------------------------------------------------------------- prompts

# text prompts for the tiny checkpoints (completions and chat); the second repeats a phrase, so n-gram drafts
# exist and get accepted
PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "import numpy as np\nx = np.arange(10)\n",
    "Speculative decoding drafts tokens",
]
# chat requests to the real SmolLM2-135M-Instruct (tests/models/test_smollm2.py): its greedy output is compared
# with transformers' and its self-draft acceptance bounded from below, figures measured on these texts
CHAT_PROMPTS = ["Write a haiku about CPUs.", "What is the capital of France?", "def fibonacci(n):"]
# repeated spans, so that n-gram and suffix drafts exist and get both accepted and rejected
REPEATED_SPAN_PROMPTS = [
    {"prompt_token_ids": [7, 40, 41, 42, 40, 41, 42, 40, 41, 42, 9]},
    {"prompt_token_ids": [100, 5, 17, 9, 33, 5, 17, 9, 33, 5, 17]},
    {"prompt_token_ids": list(range(20, 47)) + list(range(20, 30))},
    {"prompt_token_ids": [3, 250, 251, 3, 250, 251, 3]},
]
# repeated spans whose greedy continuations on the tiny checkpoints are far from ties: bfloat16 decodes the same
# tokens as float32 (tests/e2e/kernels/test_cuda_path_lossless.py)
BFLOAT16_SAFE_PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]},
    {"prompt_token_ids": [11, 12, 13, 11, 12, 13, 11]},
]
# 3, 27 (more than a chunk of 8) and 1 token(s)
EDGE_LENGTH_PROMPTS = [
    {"prompt_token_ids": [5, 17, 9]},
    {"prompt_token_ids": list(range(20, 47))},
    {"prompt_token_ids": [3]},
]


def prompts(n: int, seed: int = 0) -> list[dict]:
    """n seeded mixed-length token-id prompts with repeated spans, so that n-gram drafts exist and get both
    accepted and rejected."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(3, 300, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        noise = torch.randint(3, 300, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        out.append({"prompt_token_ids": noise + motif * 4 + noise[:3]})
    return out


def random_prompts(n: int, seed: int = 0) -> list[dict]:
    """n seeded token-id prompts of random tokens, 2 to 59 long. The engine tests' own: with their seeds, the
    continuations they stop inside are long enough for every stop rule to be exercised (tests/e2e/engine/)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 60, (n,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(3, 300, (k,), generator=g).tolist()} for k in lens]


# ---------------------------------------------------------------------------------------------- checks


# the prompt of the sampled-law tests
LAW_PROMPT = [11, 42, 7, 99, 5]


def second_token_counts(llm: LLM, prompt: list[int], sp: SamplingParams, n: int) -> torch.Tensor:
    """[V] float64: how often each token came second in n sampled generations of `prompt` (the first token
    verification produced)."""
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, sp, use_tqdm=False)
    v = llm.engine.runner.model.cfg.vocab_size
    return torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outs]), minlength=v).double()


def assert_second_token_law(llm: LLM, top_p: float = 1.0, n: int = 4000, max_tokens: int = 3) -> None:
    """n sampled 3-token (max_tokens) generations of one prompt: the second output token (the first one speculation
    produced) must follow the target's exact marginal, and the same test must reject a half-uniform mixture (its
    power)."""
    prompt = LAW_PROMPT
    sp = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=max_tokens, ignore_eos=True)
    counts = second_token_counts(llm, prompt, sp, n)
    v = counts.shape[0]
    p2 = second_token_law(llm, prompt, SamplingParams(temperature=1.0, top_p=top_p))
    assert chi2_pvalue(counts, p2) > 1e-4
    uniform_mix = 0.5 * p2 + 0.5 * torch.full_like(p2, 1.0 / v) * (p2 > 0)
    assert chi2_pvalue(counts, uniform_mix / uniform_mix.sum()) < 1e-4


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def wait_for(cond, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ---------------------------------------------------------------------------------------------- server

API_KEY = "sk-test-key"
# the plain test server's --max-request-body-bytes (set in its YAML file, tests/e2e/server/conftest.py)
BODY_LIMIT = 1 << 20
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
FIXED_K_NGRAM = NGRAM | {"enable_adaptive_verification": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m verispec.server.cli ARGS` on a free loopback port, its output in `log`."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None, nofile: int | None = None):
        """nofile: the process's descriptor limit (soft and hard), as a small machine might set it."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "verispec.server.cli", *args, "--port", str(self.port)]
        self._log_file = open(log, "w")  # noqa: SIM115 (closed in stop())

        def limit_descriptors() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=None if nofile is None else limit_descriptors,
        )

    def wait_ready(self, timeout: float = 180.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()

    def client(self, api_key: str = API_KEY, **kw) -> openai.OpenAI:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[tuple, float]:
        """{(sample name, sorted labels without model_name): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def metric(self, name: str, **labels) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


def model_config(
    heads: int = 2, kv_heads: int = 1, hidden: int = 16, inter: int = 32, vocab: int = 50
) -> ModelConfig:
    """A small Llama ModelConfig for tests that need shapes, not weights."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
