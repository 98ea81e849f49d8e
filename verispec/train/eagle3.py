"""Train an EAGLE-3 draft for a target on the target's own outputs and write it in vLLM's checkpoint format.

    .venv/bin/python -m verispec.train.eagle3 --out drafts/smollm2-eagle3 --positions 2000000 --bf16

One command, resumable: it collects until the data folder holds --positions positions, trains (saving its state
every five minutes), writes the draft. Rerun it after an interruption and both halves continue where they stopped.

1. Data (train/data.py, `collect`): the target answers conversations greedily (verispec itself); one more forward
   over each prompt + answer records, per position p, the target's streams entering the aux layers (default 2,
   L // 2, L - 3: what the proposer hands the draft) and the target's argmax there (label[p]: the token
   it would put at p + 1). Labels are the target's own picks at every position, so the draft learns what greedy
   verification accepts.
2. Model (`Eagle3Trainable`): the block of models/eagle3.py written with plain torch ops (autograd), the same
   parameter names as the checkpoint. The draft vocabulary is the `draft_vocab` most frequent labels (`d2t`), the
   LM head starts from the target's rows for them and the final norm from the target's.
3. Training-time test (`step_logits`): step 1 reads (x_{p+1}, fc(aux_p)) at position p and predicts label[p + 1];
   step k reads (x_{p+k}, the step k-1 output of the same base p) at position p + k - 1 and predicts label[p + k],
   attending to the step-1 entries 0..p and to its own base's entries of steps 2..k: exactly the entries the
   proposer's KV cache holds when it drafts k tokens after committed position p (proposers/eagle.py).
4. `save`: config.json (Llama-style, `LlamaForCausalLMEagle3`, `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`)
   and model.safetensors (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`); the target's embedding is not copied.
   OUT/training.json records the arguments, the data's manifest and the losses.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from verispec import LLM, progress
from verispec.layers.rotary import rope_inv_freq
from verispec.loader.hf import load_hf_tensors
from verispec.models.eagle3 import aux_layer_ids
from verispec.train.data import Sample, collect_shards, load_samples, write_atomic
from verispec.workloads import build_workload, training_conversations


def answer_marker(tokenizer) -> list[int]:
    """The token ids the chat template puts between a user's turn and the assistant's answer (its generation
    prompt): where every collected answer starts."""
    hole = "\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": hole}])
    return tokenizer.encode(text[text.index(hole) + 1 :], add_special_tokens=False)


def mark_answers(samples: list[Sample], marker: list[int]) -> list[Sample]:
    """Set each sample's `start` after the last occurrence of `marker` (0, everything, where it is absent)."""
    m = len(marker)
    for s in samples:
        ids = s.tokens.tolist()
        hits = [i for i in range(len(ids) - m, -1, -1) if ids[i : i + m] == marker] if m else []
        s.start = hits[0] + m if hits else 0
    return samples


# standard-library modules whose functions the prompts quote (not textwrap, shlex or json: the
PROMPT_MODULES = (
    # benchmark workloads' fallbacks)
    "argparse",
    "calendar",
    "csv",
    "difflib",
    "fractions",
    "heapq",
    "ipaddress",
    "pathlib",
    "pprint",
    "statistics",
    "string",
    "urllib.parse",
    "zipfile",
    "configparser",
    "email.utils",
    "gettext",
    "tarfile",
    "inspect",
    "typing",
    "dataclasses",
    "enum",
    "functools",
    "ast",
    "tokenize",
    "locale",
    "base64",
    "uuid",
    "datetime",
    "random",
    "subprocess",
    "shutil",
    "tempfile",
    "logging",
    "optparse",
    "mimetypes",
    "glob",
    "fnmatch",
    "posixpath",
    "copy",
    "bisect",
    "colorsys",
    "html",
    "plistlib",
    "traceback",
    "warnings",
    "netrc",
    "secrets",
    "hmac",
    "getopt",
    "cmd",
    "timeit",
    "trace",
    "pdb",
    "doctest",
    "wave",
    "graphlib",
    "linecache",
    "reprlib",
    "contextlib",
    "sysconfig",
    "platform",
    "site",
)


def python_prompts(n: int) -> list[list[dict]]:
    """n more training conversations from text that ships with Python, for the target to answer: a quarter
    "summarise this section" over the reference manual's topics (pydoc_data, 1500-character sections), the rest
    "explain this function" over standard-library functions (PROMPT_MODULES)."""
    import importlib
    import inspect
    from pydoc_data.topics import topics

    sections = [topics[k][i : i + 1500] for k in sorted(topics) for i in range(0, len(topics[k]), 1500)]
    prose = [
        [{"role": "user", "content": f"Summarise this section of the Python reference:\n\n{t}"}]
        for t in sections[: n // 4]
    ]
    funcs: list[str] = []
    for name in PROMPT_MODULES:
        for _, fn in inspect.getmembers(importlib.import_module(name), inspect.isfunction):
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if 150 < len(src) <= 1200 and src not in funcs:
                funcs.append(src)
    code = [
        [{"role": "user", "content": f"Explain what this Python function does.\n\n```python\n{f}```"}]
        for f in funcs[: n - len(prose)]
    ]
    return code + prose


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos / sin [T, 1, D] (HF rotate-half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Eagle3Trainable(nn.Module):
    """The EAGLE-3 block of models/eagle3.py (norm_before_residual off) in differentiable torch ops."""

    def __init__(self, tcfg, draft_vocab: int, target_hidden: int):
        super().__init__()
        h, self.eps = tcfg.hidden_size, tcfg.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim

        def lin(o, i):
            return nn.Parameter(torch.randn(o, i) * (1 / math.sqrt(i)))

        self.fc = lin(h, 3 * target_hidden)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            lin(q, 2 * h),
            lin(kv, 2 * h),
            lin(kv, 2 * h),
            lin(h, q),
        )
        # the block starts close to the identity on its state
        self.o_proj.data.mul_(0.1)
        inter = tcfg.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = lin(inter, h), lin(inter, h), lin(h, inter)
        self.down_proj.data.mul_(0.1)
        norms = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")
        for n in norms:
            setattr(self, n, nn.Parameter(torch.ones(h)))
        self.lm_head = nn.Parameter(torch.zeros(draft_vocab, h))
        scaling = dict(tcfg.rope_scaling) if tcfg.rope_scaling else None
        self.register_buffer(
            "inv_freq", rope_inv_freq(self.head_dim, tcfg.rope_theta, scaling), persistent=False
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, D/2]
        f = positions[:, None].float() * self.inv_freq
        # [T, 1, D]
        emb = torch.cat([f, f], -1)[:, None, :]
        return emb.cos(), emb.sin()

    def _qkv(self, e: torch.Tensor, s: torch.Tensor, positions: torch.Tensor):
        """e, s [T, H] -> (q [T, heads, D], k, v [T, heads, D] repeated over groups, residual)."""
        t = e.shape[0]
        x = torch.cat([_rms(e, self.input_layernorm, self.eps), _rms(s, self.hidden_norm, self.eps)], -1)
        cos, sin = self._rope(positions)
        q = _rope((x @ self.q_proj.T).view(t, self.heads, self.head_dim), cos, sin)
        k = _rope((x @ self.k_proj.T).view(t, self.kv_heads, self.head_dim), cos, sin)
        v = (x @ self.v_proj.T).view(t, self.kv_heads, self.head_dim)
        g = self.heads // self.kv_heads
        return q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

    def _finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [T, heads * D] -> (LM head input [T, H] (normed), output state [T, H] (pre-norm))."""
        r = attn @ self.o_proj.T + residual
        n = _rms(r, self.post_attention_layernorm, self.eps)
        out = r + (F.silu(n @ self.gate_proj.T) * (n @ self.up_proj.T)) @ self.down_proj.T
        return _rms(out, self.norm, self.eps), out

    def step_logits(self, embeds: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """embeds [T, H] of x_0..x_{T-1}, aux [T, 3 H] -> per step k (1..steps) the logits [T - k, draft vocab] of
        bases p = 0..T-1-k (step k reads x_{p+k}; its label is label[p + k])."""
        t = embeds.shape[0]
        scale = self.head_dim**-0.5
        # step 1: base p reads x_{p+1} and aux_p
        s = aux[: t - 1] @ self.fc.T
        pos = torch.arange(t - 1)
        q, k1, v1 = self._qkv(embeds[1:], s, pos)
        causal = torch.ones(t - 1, t - 1, dtype=torch.bool).tril()
        scores = torch.einsum("qhd,khd->hqk", q, k1) * scale
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v1)
        head_in, state = self._finish(attn.reshape(t - 1, -1), s)
        logits = [head_in @ self.lm_head.T]
        # bases' own entries of steps 2..k: [T - 1, heads, D] each
        diag_k, diag_v = [], []
        for k in range(2, steps + 1):
            # bases 0..n-1 still have a token x_{p+k}
            n = t - k
            state = state[:n]
            q, kk, vv = self._qkv(embeds[k : k + n], state, pos[:n] + k - 1)
            diag_k, diag_v = [d[:n] for d in diag_k] + [kk], [d[:n] for d in diag_v] + [vv]
            # [heads, n, T - 1]
            prefix = torch.einsum("qhd,khd->hqk", q, k1) * scale
            prefix = prefix.masked_fill(~causal[:n], float("-inf"))
            # [heads, n, k - 1]
            own = torch.stack([(q * d).sum(-1) for d in diag_k], -1).transpose(0, 1) * scale
            w = torch.cat([prefix, own], -1).softmax(-1)
            attn = torch.einsum("hqk,khd->qhd", w[..., : t - 1], v1) + torch.einsum(
                "hqj,jqhd->qhd", w[..., t - 1 :], torch.stack(diag_v)
            )
            head_in, state = self._finish(attn.reshape(n, -1), state)
            logits.append(head_in @ self.lm_head.T)
        return logits

    def checkpoint(self, d2t: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors in vLLM's EAGLE-3 names."""
        mid = ("q_proj", "k_proj", "v_proj", "o_proj")
        out = {f"midlayer.self_attn.{n}.weight": getattr(self, n) for n in mid}
        out |= {f"midlayer.mlp.{n}.weight": getattr(self, n) for n in ("gate_proj", "up_proj", "down_proj")}
        out |= {
            f"midlayer.{n}.weight": getattr(self, n)
            for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        }
        out |= {"fc.weight": self.fc, "norm.weight": self.norm, "lm_head.weight": self.lm_head, "d2t": d2t}
        return {k: v.detach().contiguous().clone() for k, v in out.items()}


def load_trainable(folder: Path, tcfg) -> tuple[Eagle3Trainable, torch.Tensor]:
    """A written draft (model.safetensors, or model.gguf's Q8_0 blocks dequantized) -> (the trainable block holding
    its weights, t2d: target id -> draft id or -1), to score it with `evaluate` as stored."""

    tensors = load_hf_tensors(Path(folder))
    if "d2t" not in tensors or "lm_head.weight" not in tensors:
        raise ValueError(f"{folder}: not an EAGLE-3 draft written by this trainer (no d2t / lm_head.weight)")
    d2t = tensors["d2t"].long()
    ids = d2t + torch.arange(len(d2t))
    model = Eagle3Trainable(tcfg, len(d2t), tensors["fc.weight"].shape[1] // 3)
    names = model.checkpoint(d2t).keys() - {"d2t"}
    attr = {k: k.split(".")[-2] if k.startswith("midlayer.") else k.split(".")[0] for k in names}
    with torch.no_grad():
        for key in names:
            getattr(model, attr[key]).copy_(tensors[key].float())
    t2d = torch.full((tcfg.vocab_size,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(len(ids))
    return model, t2d


def draft_vocabulary(samples: list[Sample], size: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent labels -> (draft id -> target id [size] ascending, target id -> draft id or -1)."""
    counts = torch.bincount(torch.cat([s.labels for s in samples]), minlength=vocab)
    ids = counts.topk(min(size, vocab)).indices.sort().values
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(len(ids))
    return ids, t2d


@torch.no_grad()
def target_embeds(target, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [T] -> the target's input embeddings [T, H] in float32 on the CPU, where the draft trains (the target
    may serve from CUDA)."""
    device = target.embed_tokens.weight.device
    return target.embed(tokens.to(device)).float().cpu()


@torch.no_grad()
def chain_lengths(
    model: Eagle3Trainable, samples: list[Sample], target, t2d: torch.Tensor, steps: int, bf16: bool = False
) -> list[torch.Tensor]:
    """Teacher-forced greedy chains on held-out samples: per sample, [bases] how many of the `steps` drafts started
    at each answer base (from start - 1) equal the target's picks before the first miss (what greedy verification
    accepts of a chain started there)."""
    out = []
    for s in samples:
        t = len(s.tokens)
        # bases 0..n-1 have all `steps` drafts; those from start - 1 on draft the answer (the engine's chains)
        n, first = t - steps, max(0, s.start - 1)
        if t <= steps + 1 or first >= n:
            continue
        embeds = target_embeds(target, s.tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model.step_logits(embeds, s.aux.float(), steps)
        ok = torch.ones(n - first, dtype=torch.bool)
        length = torch.zeros(n - first, dtype=torch.long)
        for k, lg in enumerate(logits, start=1):
            ok &= lg[first:n].argmax(-1) == t2d[s.labels[first + k : k + n]]
            length += ok
        out.append(length)
    return out


def walk_length(lengths: torch.Tensor) -> tuple[int, int]:
    """One sample's chain lengths at consecutive bases -> (tokens, steps) of greedy decoding that verifies a chain
    at each step: a step at base p commits its accepted drafts and the target's token, so the next step starts
    at p + length[p] + 1. Steps start more often where drafts fail, so tokens / steps is the engine's mean
    acceptance length, below the average over all bases when easy and hard stretches cluster."""
    steps, p, n = 0, 0, len(lengths)
    host = lengths.tolist()
    while p < n:
        steps += 1
        p += host[p] + 1
    return n, steps


def scores(lengths: list[torch.Tensor], steps: int) -> tuple[list[float], float]:
    """Chain lengths (`chain_lengths`) -> (for k = 1..steps the share of bases whose drafts 1..k are all accepted,
    the engine's mean acceptance length over `walk_length`). A chain started at every base averages 1 + the sum
    of the shares; the engine's chains start where the last one ended, which the second figure follows."""
    flat = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.long)
    shares = [float((flat >= k).float().mean()) if len(flat) else 0.0 for k in range(1, steps + 1)]
    walks = [walk_length(x) for x in lengths]
    return shares, sum(t for t, _ in walks) / max(1, sum(n for _, n in walks))


def evaluate(
    model: Eagle3Trainable, samples: list[Sample], target, t2d: torch.Tensor, steps: int, bf16: bool = False
) -> list[float]:
    """Held-out acceptance: for k = 1..steps, the share of answer bases whose drafts 1..k all equal the target's
    picks (`scores`' first figure)."""
    return scores(chain_lengths(model, samples, target, t2d, steps, bf16), steps)[0]


def _save_state(folder: Path, model: nn.Module, opt: torch.optim.Optimizer, info: dict) -> None:
    """Training state in safetensors + JSON (no pickle): parameters, AdamW's moments and the counters."""

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"param.{n}": p.detach() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        st = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                tensors[f"{key}.{n}"] = st[key]
        if "step" in st:
            info["adam_step"] = float(st["step"])
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    write_atomic(folder / "state.safetensors", lambda p: save_file(tensors, str(p)))
    write_atomic(folder / "state.json", lambda p: p.write_text(json.dumps(info, indent=1)))


def _load_state(folder: Path, model: nn.Module, opt: torch.optim.Optimizer) -> dict | None:

    if not (folder / "state.json").exists():
        return None
    try:
        info = json.loads((folder / "state.json").read_text())
        tensors = load_file(str(folder / "state.safetensors"))
    # safetensors raises its own error types for a missing or corrupt file
    except Exception as e:
        raise ValueError(
            f"{folder}: unreadable training state ({e}); remove the folder to start over"
        ) from None
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"param.{n}"])
            if f"exp_avg.{n}" in tensors:
                step = torch.tensor(info["adam_step"])
                opt.state[p] = {
                    "step": step,
                    "exp_avg": tensors[f"exp_avg.{n}"],
                    "exp_avg_sq": tensors[f"exp_avg_sq.{n}"],
                }
    return info


def train(
    samples: list[Sample],
    target,
    draft_vocab: int = 8192,
    steps: int = 3,
    epochs: int = 4,
    lr: float = 1e-3,
    seed: int = 0,
    log_every: int = 50,
    state_dir: Path | None = None,
    save_every_s: float = 300.0,
    bf16: bool = False,
    eval_samples: list[Sample] | None = None,
    eval_every: int = 0,
) -> tuple[Eagle3Trainable, torch.Tensor, list[float]]:
    """-> (the draft, d2t [draft_vocab], the mean loss of each epoch). target: the target DecoderLM (embedding,
    final norm and LM head rows). One sequence per optimizer step.

    state_dir: where the training state is saved every save_every_s seconds and at the end; a later call with the
    same samples and arguments resumes from it (the epoch orders follow from the seed). bf16: matrix products in
    bfloat16 under autocast (AMX / AVX512-BF16), the parameters and the optimizer in float32. eval_samples: held-out
    data scored by `evaluate` every eval_every sequences and at the end, kept in the state's "curve" (the learning
    curve: training positions seen against held-out acceptance)."""
    torch.manual_seed(seed)
    cfg = target.cfg
    ids, t2d = draft_vocabulary(samples, draft_vocab, cfg.vocab_size)
    model = _draft_from_target(target, ids, samples[0].aux.shape[-1] // 3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    total = epochs * len(samples)
    info = _resume(state_dir, model, opt, total)
    # warm-up then cosine, counted from the first step of the run (a resumed run starts at info["done"])
    done = info["done"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (done + i + 1) / 50) * 0.5 * (1 + math.cos(math.pi * (done + i) / total))
    )
    t0, saved = time.perf_counter(), time.perf_counter()

    def score() -> None:
        _score(model, eval_samples, target, t2d, steps, bf16, info, bar)

    bar = progress.bar(total=total, desc="training", unit="seq", initial=info["done"])
    while info["done"] < total:
        epoch, start = divmod(info["done"], len(samples))
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        losses = info.setdefault("epoch_losses", [])
        for i in range(start, len(samples)):
            s = samples[order[i]]
            losses.append(_train_step(model, opt, sched, target, s, t2d, steps, bf16))
            info["done"] += 1
            info["seen"] += len(s.tokens)
            bar.update()
            bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.3f}", refresh=False)
            if log_every and (i + 1) % log_every == 0:
                # printed above the bar, which is redrawn below it
                with bar.external_write_mode():
                    print(
                        f"epoch {epoch} step {i + 1}/{len(samples)} loss "
                        f"{sum(losses[-log_every:]) / log_every:.3f} ({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
            if eval_samples and eval_every and info["done"] % eval_every == 0:
                score()
            if state_dir is not None and time.perf_counter() - saved > save_every_s:
                _save_state(state_dir, model, opt, info)
                saved = time.perf_counter()
        info["history"].append(sum(losses) / len(losses))
        info["epoch_losses"] = []
    if eval_samples and not (info["curve"] and info["curve"][-1]["positions"] == info["seen"]):
        score()
    bar.close()
    if state_dir is not None:
        _save_state(state_dir, model, opt, info)
    return model, ids - torch.arange(len(ids)), info["history"]


def _score(model, eval_samples: list[Sample], target, t2d, steps: int, bf16: bool, info: dict, bar) -> None:
    """The held-out acceptance now, appended to the run's learning curve and printed above the progress bar."""
    # labels outside the draft vocabulary map to -1, which no argmax equals
    acc, walk = scores(chain_lengths(model, eval_samples, target, t2d, steps, bf16), steps)
    point = {
        "positions": info["seen"],
        "acceptance": [round(a, 4) for a in acc],
        "engine_length": round(walk, 4),
    }
    info["curve"].append(point)
    with bar.external_write_mode():
        print(
            f"held-out after {info['seen']} positions: acceptance {' / '.join(f'{a:.3f}' for a in acc)}, "
            f"mean acceptance length at K={steps} {1 + sum(acc):.2f} per base, {walk:.2f} per engine step",
            flush=True,
        )


def _draft_from_target(target, ids: torch.Tensor, hidden: int) -> Eagle3Trainable:
    """A new draft whose LM head holds the target's rows of the draft vocabulary and whose final norm is the
    target's."""
    model = Eagle3Trainable(target.cfg, len(ids), hidden)
    with torch.no_grad():
        q = target.lm_head.qweight
        # [V, H]
        head = q.dequantize() if q is not None else target.lm_head.weight
        model.lm_head.copy_(head.float()[ids])
        model.norm.copy_(target.norm.weight.float())
    return model


def _resume(state_dir: Path | None, model: Eagle3Trainable, opt, total: int) -> dict:
    """The run's progress: loaded from state_dir (model and optimizer too) when it holds this run, else new."""
    info = {"done": 0, "seen": 0, "history": [], "epoch_losses": [], "curve": []}
    resumed = _load_state(state_dir, model, opt) if state_dir is not None else None
    if resumed is not None:
        if resumed.get("total") != total:
            raise ValueError(
                f"{state_dir} holds a run of {resumed.get('total')} steps, not {total}: other data or "
                "epochs; remove the folder to start over"
            )
        info = resumed
    info["total"] = total
    return info


def _train_step(model, opt, sched, target, s: Sample, t2d: torch.Tensor, steps: int, bf16: bool) -> float:
    """One optimizer step on one sequence: the draft unrolled `steps` times, each step's loss weighted 0.8^(k-1).
    -> the loss."""
    embeds = target_embeds(target, s.tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model.step_logits(embeds, s.aux.float(), steps)
    loss = 0.0
    for k, lg in enumerate(logits, start=1):
        # -1: outside the draft vocabulary (ignored)
        lab = t2d[s.labels[k : k + lg.shape[0]]]
        # only answer tokens count: label index j = p + k predicts position j + 1
        lab[: max(0, s.start - k)] = -1
        loss = loss + (0.8 ** (k - 1)) * F.cross_entropy(lg.float(), lab, ignore_index=-1)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(loss.detach())


def write_q8_0(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """The tensors as a GGUF file under their own names: matrices whose rows hold whole 32-value blocks as Q8_0
    (gguf's quantizer), the rest as F32, integer tensors as I32. About a quarter of float32's size."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch="eagle3-draft")
    for name, t in tensors.items():
        if not t.dtype.is_floating_point:
            writer.add_tensor(name, t.numpy().astype(np.int32))
        elif t.dim() == 2 and t.shape[1] % 32 == 0:
            q = gguf.quants.quantize(t.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, t.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def save(
    model: Eagle3Trainable,
    d2t: torch.Tensor,
    folder: Path,
    tcfg,
    aux_layers: tuple[int, ...],
    weights: str = "float32",
) -> None:
    """tcfg: the target's ModelConfig (the draft block has the target's dimensions). weights: "float32"
    (model.safetensors, vLLM's format) or "q8_0" (model.gguf: the quantized target's weight format, the blocks
    its CPU kernels run the draft with)."""

    folder.mkdir(parents=True, exist_ok=True)
    tensors = model.checkpoint(d2t)
    for stale in ("model.safetensors", "model.gguf"):
        (folder / stale).unlink(missing_ok=True)
    if weights == "q8_0":
        write_q8_0(tensors, folder / "model.gguf")
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": tcfg.hidden_size,
        "intermediate_size": tcfg.intermediate_size,
        "num_attention_heads": tcfg.num_heads,
        "num_key_value_heads": tcfg.num_kv_heads,
        "head_dim": tcfg.head_dim,
        "rms_norm_eps": tcfg.rms_norm_eps,
        "rope_theta": tcfg.rope_theta,
        "rope_scaling": dict(tcfg.rope_scaling) if tcfg.rope_scaling else None,
        "max_position_embeddings": tcfg.max_position_embeddings,
        "vocab_size": tcfg.vocab_size,
        "hidden_act": tcfg.hidden_act,
        "tie_word_embeddings": False,
        "draft_vocab_size": int(d2t.shape[0]),
        "target_hidden_size": tcfg.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m verispec.train.eagle3", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True, help="folder for config.json + model.safetensors")
    ap.add_argument(
        "--data", help="folder of collected shards, created or extended (default: OUT/../<OUT name>-data)"
    )
    ap.add_argument(
        "--positions", type=int, default=300_000, help="train on the first shards holding this many positions"
    )
    ap.add_argument("--shard-size", type=int, default=128, help="conversations per shard")
    ap.add_argument("--max-tokens", type=int, default=384, help="answer length cap")
    ap.add_argument(
        "--activation-dtype",
        choices=("float32", "int8"),
        default="float32",
        help="the target's numerics while collecting (answers, states, labels); int8 collects about 2x faster",
    )
    ap.add_argument(
        "--heldout",
        help="folder for the held-out set: the target's answers to the chat benchmark's questions (MT-bench's "
        "first 40, never trained on); default OUT/../<OUT name>-heldout",
    )
    ap.add_argument(
        "--eval-every", type=int, default=400, help="score the held-out set every this many sequences"
    )
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps (drafts per base)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bf16", action="store_true", help="matrix products in bfloat16 (AMX / AVX512-BF16)")
    ap.add_argument(
        "--weights",
        choices=("float32", "q8_0"),
        default="float32",
        help="float32: model.safetensors (vLLM's format); q8_0: model.gguf, a quarter of the size",
    )
    ap.add_argument(
        "--evaluate",
        metavar="DRAFT",
        help="only score this written draft folder on the held-out set (collected first if missing, with "
        "--activation-dtype's numerics) and print its teacher-forced acceptance; nothing is trained",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    # bars on stderr only on a terminal, none with --quiet
    progress.set_quiet(args.quiet)
    for key in ("positions", "shard_size", "max_tokens", "draft_vocab", "ttt_steps", "epochs", "eval_every"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be at least 1, got {getattr(args, key)}")
    if not args.lr > 0:
        ap.error(f"--lr must be positive, got {args.lr}")
    for key in ("out", "data", "heldout", "evaluate"):
        path = getattr(args, key)
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            ap.error(f"--{key} {path} is a file; give a folder")
    try:
        evaluate_draft(args) if args.evaluate else run(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _heldout(llm, args: argparse.Namespace, aux: tuple[int, ...]) -> list[Sample]:
    """The held-out samples (--heldout, default OUT/../<OUT name>-heldout), collected first if missing."""

    out = Path(args.out)
    heldout = Path(args.heldout) if args.heldout else out.parent / f"{out.name}-heldout"
    collect_shards(
        llm,
        args.model,
        heldout,
        1 << 62,
        build_workload("chat", 40),
        aux,
        shard_size=args.shard_size,
        max_tokens=args.max_tokens,
        activation_dtype=args.activation_dtype,
        self_instruct=False,
    )
    return mark_answers(load_samples(heldout), answer_marker(llm.tokenizer))


def evaluate_draft(args: argparse.Namespace) -> None:
    """--evaluate DRAFT: the written draft's teacher-forced acceptance on the held-out set, as stored (Q8_0
    blocks dequantized), under the held-out set's numerics."""

    llm = LLM(args.model, max_model_len=2048, max_num_seqs=64, activation_dtype=args.activation_dtype)
    model = llm.ckpt.model
    draft, t2d = load_trainable(Path(args.evaluate), model.cfg)
    samples = _heldout(llm, args, aux_layer_ids({}, model.cfg.num_layers))
    acc, walk = scores(chain_lengths(draft, samples, model, t2d, args.ttt_steps, args.bf16), args.ttt_steps)
    print(
        f"{args.evaluate}: held-out acceptance {' / '.join(f'{a:.3f}' for a in acc)}; mean acceptance length "
        f"at K={args.ttt_steps} {1 + sum(acc):.2f} per base, {walk:.2f} per engine step ({len(samples)} "
        f"sequences, {args.activation_dtype} states)"
    )


def run(args: argparse.Namespace) -> None:
    """Collect until the data folder holds --positions positions, train (resuming from OUT/train_state), write
    the draft and OUT/training.json (the command, the data's manifest, the losses). Rerun the same command after
    an interruption: both halves continue where they stopped."""

    out = Path(args.out)
    data = Path(args.data) if args.data else out.parent / f"{out.name}-data"
    llm = LLM(args.model, max_model_len=2048, max_num_seqs=64, activation_dtype=args.activation_dtype)
    model = llm.ckpt.model
    aux = aux_layer_ids({}, model.cfg.num_layers)
    t0 = time.perf_counter()
    manifest = collect_shards(
        llm,
        args.model,
        data,
        args.positions,
        training_conversations(40, 64) + python_prompts(600),
        aux,
        shard_size=args.shard_size,
        max_tokens=args.max_tokens,
        activation_dtype=args.activation_dtype,
    )
    print(f"{data}: {manifest['positions']} positions ({time.perf_counter() - t0:.0f} s)", flush=True)
    eval_samples = _heldout(llm, args, aux)
    heldout = Path(args.heldout) if args.heldout else out.parent / f"{out.name}-heldout"
    samples = mark_answers(load_samples(data, args.positions), answer_marker(llm.tokenizer))
    n = sum(len(s.tokens) for s in samples)
    counts = torch.bincount(torch.cat([s.labels for s in samples]), minlength=model.cfg.vocab_size)
    cover = float(counts.sort(descending=True).values[: args.draft_vocab].sum() / counts.sum())
    print(
        f"training on {len(samples)} sequences, {n} positions; the {args.draft_vocab} most frequent labels "
        f"cover {100 * cover:.1f}% of them",
        flush=True,
    )
    draft, d2t, history = train(
        samples,
        model,
        args.draft_vocab,
        args.ttt_steps,
        args.epochs,
        args.lr,
        state_dir=out / "train_state",
        bf16=args.bf16,
        eval_samples=eval_samples,
        eval_every=args.eval_every,
    )
    state = json.loads((out / "train_state" / "state.json").read_text())
    save(draft, d2t, out, model.cfg, aux, args.weights)
    used = []
    for entry in manifest["shards"]:
        used.append(entry)
        if sum(e["positions"] for e in used) >= args.positions:
            break
    report = {
        "arguments": vars(args),
        "positions": n,
        "sequences": len(samples),
        "draft_vocab_coverage": round(cover, 4),
        "epoch_losses": history,
        "heldout": f"{heldout} (the chat benchmark's questions: MT-bench's first 40)",
        "learning_curve": state["curve"],
        "data": {k: v for k, v in manifest.items() if k != "shards"} | {"shards": used},
    }
    (out / "training.json").write_text(json.dumps(report, indent=1))
    print(f"epoch losses {', '.join(f'{x:.3f}' for x in history)}; wrote {out}")


if __name__ == "__main__":
    main()
