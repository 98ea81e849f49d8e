"""The engine's settings, resolved once by build_engine."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.sample.metadata import VerifyRule


@dataclass
class EngineOptions:
    max_model_len: int
    max_num_batched_tokens: int = 1024
    num_speculative_tokens: int = 0
    verify: VerifyRule = VerifyRule()
    disable_by_batch_size: int | None = None
    log_interval_s: float = 10.0
    # Most tokens one decode step may score (committed + drafts) under fixed K. Verifying more rows than this turns
    # the forward compute-bound (on a CPU from a few dozen rows), so at large batch each request gets fewer drafts.
    spec_token_budget: int = 32
    # speculative_config.max_model_len: no drafts past this length
    draft_max_model_len: int | None = None
    # num_speculative_tokens_per_batch_size: [(start_bs, end_bs, K), ...], K by decode batch size
    spec_schedule: tuple[tuple[int, int, int], ...] | None = None
    # per_request_spec_decode_metrics: none (no verify steps kept) | summary | detailed
    spec_metrics: str = "none"
    enable_prefix_caching: bool = True
