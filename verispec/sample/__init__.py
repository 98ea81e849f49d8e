"""Sampling and verification, in one package.

- ``logits``: batched logits processing (temperature, top-k / top-p / min-p, penalties), plain sampling, logprobs.
- ``constraints``: per-request constraints (allowed tokens, bad words, logit bias, min_tokens, penalty state).
- ``verify``: rejection sampling as pure tensor functions (strict, probabilistic, synthetic, Block / Entropy Verify).
- ``metadata``: what the engine passes in: the step's drafts and the verification rule chosen once.
- ``step``: one step's logits to emitted tokens, plain decoding being the zero-draft case of verification.
"""
