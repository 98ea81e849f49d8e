"""llama.cpp (through llama-cpp-python) as a peer: the engine people run GGUF models with on a CPU.

Not a dependency of verispec: `pip install --no-deps llama-cpp-python==0.3.36 diskcache` compiles llama.cpp
(~10 minutes on 2 cores). Both engines get the same token ids (verispec's tokenizer; no BOS is added), greedy
decoding, the same thread count; llama.cpp computes with its own kernels (8-bit activations for Q4 / Q8 weights),
so its greedy text may differ from the float32 one: the scripts count identical outputs.
"""

from __future__ import annotations

import time
from pathlib import Path

# llama.cpp's default on a CPU with AMX puts Q4_1 / Q8_0 weights in its AMX buffers, and on this model (SmolLM2-135M
# Q4_1, llama-cpp-python 0.3.36) the first decode then dies in ggml_backend_amx_mul_mat (SIGSEGV). The peer turns
# those extra buffer types off (llama_model_params.use_extra_bufts, llama.cpp's --no-repack): its AVX-512 kernels.
EXTRA_BUFFERS = False


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def load(
    gguf: Path,
    threads: int,
    lookup: int | None = None,
    max_ngram: int = 2,
    n_ctx: int = 2048,
    logits_all: bool = False,
):
    """A llama.cpp model; lookup: prompt lookup decoding with this many drafts (llama-cpp-python's
    LlamaPromptLookupDecoding, its n-gram proposer); logits_all: keep every position's logits (model.scores), as
    greedy_logprobs needs."""
    import llama_cpp

    # the bindings Llama reads its defaults from
    import llama_cpp.llama_cpp as capi
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(max_ngram_size=max_ngram, num_pred_tokens=lookup) if lookup else None
    defaults = capi.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = EXTRA_BUFFERS
        return p

    capi.llama_model_default_params = params
    try:
        return llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            logits_all=logits_all,
            verbose=False,
        )
    finally:
        capi.llama_model_default_params = defaults


def generate(
    model, prompt: list[int], max_tokens: int, eos: set[int], keep_prefix: bool = False
) -> list[int]:
    """Greedy tokens after `prompt`, up to max_tokens, EOS included (as verispec reports it). The model's state is
    reset first unless keep_prefix: llama-cpp-python then reuses the previous call's shared prefix (its prompt
    cache, as llama.cpp's server reuses a slot's), for benchmarks/prefix_cache.py."""
    if not keep_prefix:
        model.reset()
    out: list[int] = []
    for t in model.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(int(t))
        if t in eos or len(out) >= max_tokens:
            break
    return out


def greedy_logprobs(
    model, prompt: list[int], max_tokens: int, k: int
) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy tokens after `prompt` (max_tokens of them, EOS not stopping), each with the top-k logprobs (float64
    log-softmax of llama.cpp's float32 logits) of the position that chose it. model: load(..., logits_all=True)."""
    import numpy as np

    model.reset()
    model.eval(prompt)
    toks: list[int] = []
    tops: list[dict[int, float]] = []
    for _ in range(max_tokens):
        # [V] the logits of the last evaluated position
        x = np.asarray(model.scores[model.n_tokens - 1], dtype=np.float64)
        x = x - x.max()
        lp = x - np.log(np.exp(x).sum())
        t = int(lp.argmax())
        top = [t] + [int(i) for i in np.argsort(-lp, kind="stable")[:k] if i != t][: k - 1]
        toks.append(t)
        tops.append({i: float(lp[i]) for i in top})
        model.eval([t])
    return toks, tops


def run(model, prompts: list[list[int]], max_tokens: int, eos: set[int]) -> tuple[float, list[list[int]]]:
    """-> (seconds for all prompts one after another, their outputs); one untimed warm-up generate first."""
    generate(model, prompts[0][:8], 2, eos)
    t = time.perf_counter()
    outs = [generate(model, p, max_tokens, eos) for p in prompts]
    return time.perf_counter() - t, outs


def decode_speed(
    model, prompt: list[int], new_tokens: int, repeats: int
) -> tuple[float, float, list[int], float]:
    """-> (end-to-end tok/s, decode-only tok/s: the same generate minus a 1-token generate (the prompt), medians of
    repeats, the tokens, prompt tok/s: len(prompt) / the 1-token generate, median); EOS ignored, as in verispec's
    decode benchmark."""
    import statistics

    # untimed warm-up
    generate(model, prompt, new_tokens, set())
    e2e, dec, pre = [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        out = generate(model, prompt, new_tokens, set())
        dt = time.perf_counter() - t
        t = time.perf_counter()
        generate(model, prompt, 1, set())
        prefill = time.perf_counter() - t
        e2e.append(new_tokens / dt)
        dec.append((new_tokens - 1) / (dt - prefill))
        pre.append(len(prompt) / prefill)
    return statistics.median(e2e), statistics.median(dec), out, statistics.median(pre)
