"""Training data for draft heads, collected in shards so a long collection survives interruptions.

A data folder holds `manifest.json` and `shard_00000.safetensors`, `shard_00001.safetensors`, ... Each shard is
a group of conversations the target answered greedily, with what `eagle3.target_states` records for them:

- `tokens` [N] int32: the sequences (prompt + answer) one after another;
- `offsets` [S + 1] int64: sequence s is tokens[offsets[s]:offsets[s + 1]];
- `aux` [N, 3 H] bfloat16: the target's streams entering the aux layers;
- `labels` [N] int32: the target's argmax at every position (in the folder's numerics).

The manifest names the model, the aux layers, the seed and, per shard, its source and size. `collect_shards`
resumes from the last complete shard: shard i's conversations depend only on (seed, i), so an interrupted
collection continues exactly where it stopped.

Sources, in order: the curated conversations (MT-bench questions from the 41st, HumanEval problems from the
101st, and the Python-text conversations of `eagle3.python_prompts`), then self-instructed ones: the target
writes the user's turn itself when handed its chat template up to the user's turn (Magpie, Xu et al. 2024,
arXiv 2406.08464), at temperature 1, and then answers it. Those follow the target's own distribution of requests
and cost nothing to download.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from verispec import SamplingParams, progress
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner, RowInput
from verispec.workloads import chat_prompt_ids

MANIFEST = "manifest.json"


@dataclass
class Shard:
    # [N] int32
    tokens: torch.Tensor
    # [S + 1] int64
    offsets: torch.Tensor
    # [N, 3 H] bfloat16
    aux: torch.Tensor
    # [N] int32
    labels: torch.Tensor


def self_instruct_queries(llm, n: int, seed: int, max_tokens: int = 128) -> list[str]:
    """Up to n user requests written by the target itself (Magpie): its chat template up to the user's turn,
    sampled at temperature 1 until the end of the turn. Requests cut at max_tokens or shorter than 16 characters
    are dropped."""

    tok = llm.tokenizer
    marker = "\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}])
    head = tok.encode(text[: text.index(marker)], add_special_tokens=False)
    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed * 100_003 + i) for i in range(n)
    ]
    outs = llm.generate([{"prompt_token_ids": head}] * n, params, use_tqdm=False)
    queries = []
    for o in outs:
        c = o.outputs[0]
        q = c.text.strip()
        if c.finish_reason == "stop" and len(q) >= 16 and q not in queries:
            queries.append(q)
    return queries


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_shard(path: Path, samples) -> tuple[int, int]:
    """samples: eagle3.Sample list -> (sequences, positions) written."""

    lengths = torch.tensor([0] + [len(s.tokens) for s in samples])
    tensors = {
        "tokens": torch.cat([s.tokens for s in samples]).to(torch.int32),
        "offsets": lengths.cumsum(0),
        "aux": torch.cat([s.aux for s in samples]).to(torch.bfloat16),
        "labels": torch.cat([s.labels for s in samples]).to(torch.int32),
    }
    write_atomic(path, lambda p: save_file(tensors, str(p)))
    return len(samples), int(lengths.sum())


def read_shard(path: Path) -> Shard:

    try:
        t = load_file(str(path))
        return Shard(t["tokens"], t["offsets"], t["aux"], t["labels"])
    # safetensors raises its own error types for a missing or corrupt file; a shard of another format lacks keys
    except Exception as e:
        raise ValueError(
            f"{path}: missing or corrupt shard ({e}); remove it and its manifest entry to recollect"
        ) from None


def load_samples(folder: Path, max_positions: int | None = None) -> list:
    """The folder's sequences as eagle3.Sample (aux kept in bfloat16), shard by shard up to max_positions."""

    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{folder} has no {MANIFEST}: collect data first (the `collect` subcommand)")
    samples, n = [], 0
    for entry in manifest["shards"]:
        shard = read_shard(folder / entry["file"])
        bounds = shard.offsets.tolist()
        for a, b in zip(bounds, bounds[1:]):
            samples.append(Sample(shard.tokens[a:b].long(), shard.aux[a:b], shard.labels[a:b].long()))
        n += entry["positions"]
        if max_positions is not None and n >= max_positions:
            break
    return samples


def collect_shards(
    llm,
    model_name: str,
    folder: Path,
    positions: int,
    curated: list[list[dict]],
    aux_layers: tuple[int, ...],
    shard_size: int = 64,
    max_tokens: int = 384,
    seed: int = 0,
    activation_dtype: str = "float32",
    self_instruct: bool = True,
    log=print,
) -> dict:
    """Add shards to `folder` until it holds at least `positions` positions; -> the manifest.

    llm: the target, which writes the requests and answers and records the states and labels, in the numerics
    `activation_dtype` names (int8 activations collect about twice as fast; a folder keeps one numerics).
    self_instruct=False stops once the curated conversations are used up (a held-out set)."""

    folder.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(folder) or {
        "model": model_name,
        "activation_dtype": activation_dtype,
        "aux_layers": list(aux_layers),
        "seed": seed,
        "max_tokens": max_tokens,
        "shard_size": shard_size,
        "sources": "curated conversations, then self-instructed ones (verispec/train/data.py)",
        "positions": 0,
        "shards": [],
    }
    expected = (
        ("model", model_name),
        ("activation_dtype", activation_dtype),
        ("aux_layers", list(aux_layers)),
    )
    for key, value in expected:
        if manifest[key] != value:
            raise ValueError(f"{folder} holds data for {key}={manifest[key]!r}, not {value!r}")
    seed, shard_size, max_tokens = manifest["seed"], manifest["shard_size"], manifest["max_tokens"]
    tok = llm.tokenizer
    t0 = time.perf_counter()
    while manifest["positions"] < positions:
        i = len(manifest["shards"])
        if i * shard_size < len(curated):
            convs, source = curated[i * shard_size : (i + 1) * shard_size], "curated"
        elif not self_instruct:
            break
        else:
            queries = self_instruct_queries(llm, shard_size, seed + i)
            if not queries:
                raise ValueError(
                    f"shard {i}: the target wrote no complete user request in {shard_size} tries (self-instruct); "
                    "it needs a chat template and an end-of-turn token it emits"
                )
            convs, source = [[{"role": "user", "content": q}] for q in queries], "self-instruct"
        prompts = chat_prompt_ids(tok, convs)
        samples = collect(llm, prompts, max_tokens, aux_layers)
        name = f"shard_{i:05d}.safetensors"
        seqs, n = write_shard(folder / name, samples)
        manifest["shards"].append({"file": name, "source": source, "sequences": seqs, "positions": n})
        manifest["positions"] += n
        write_atomic(folder / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1)))
        log(
            f"{name}: {source}, {seqs} sequences, {n} positions; {manifest['positions']} in all "
            f"({time.perf_counter() - t0:.0f} s)"
        )
    return manifest


@dataclass
class Sample:
    # [T] prompt + answer
    tokens: torch.Tensor
    # [T, 3 H] the target's streams entering the aux layers, per position
    aux: torch.Tensor
    # [T] the target's argmax at each position (its pick for position p + 1)
    labels: torch.Tensor
    # the answer's first position: a base p drafts answer tokens when p + 1 >= start (the chat template's
    # prompt before it is the same in every conversation; learning it teaches the draft nothing it will use)
    start: int = 0


def collect(llm, prompts: list[list[int]], max_tokens: int, aux_layers: tuple[int, ...]) -> list[Sample]:
    """Greedy answers from the target, then one forward per prompt + answer for its states and argmaxes."""

    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=progress.enabled())
    return target_states(llm, [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)], aux_layers)


@torch.no_grad()
def target_states(llm, sequences: list[list[int]], aux_layers: tuple[int, ...]) -> list[Sample]:
    """One target forward per sequence: the streams entering `aux_layers` and the argmax at every position.

    Without autograd, as the engine runs (on CUDA the labels then come from the same batch-invariant kernels)."""

    model, device = llm.ckpt.model, llm.engine.runner.device
    # the cache holds K and V in the model's dtype (bfloat16 on CUDA)
    cache = KVCache(model.cfg, 1, max(len(t) for t in sequences) + 1, device, model.embed_tokens.weight.dtype)
    runner = ModelRunner(model, cache, device)
    samples = []
    for tokens in progress.bar(sequences, desc="target states", unit="seq"):
        res = runner.run([RowInput(0, 0, tokens)], aux_layers, aux_all=True, hidden_all=True)
        # [T]
        labels = model.compute_logits(res.hidden_all).argmax(-1)
        # [T, 3 H], out of inference mode (training reads it under autograd)
        aux = res.aux_hidden.clone()
        samples.append(Sample(torch.tensor(tokens), aux.float().cpu(), labels.cpu()))
    return samples
