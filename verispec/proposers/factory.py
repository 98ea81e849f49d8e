"""The single factory mapping a resolved SpeculativeConfig to a proposer. The engine never sees method names."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from verispec.config import ModelConfig, model_config_from_hf
from verispec.drafts import shipped_draft
from verispec.layers.linear import keeps_quantized, quantize_dense_layers, use_int8_activations
from verispec.layers.trimmed_head import trim_head
from verispec.loader.aliases import ALIASES
from verispec.loader.checkpoint import fuse_if_enabled, load_checkpoint, read_lm_head, resolve_model_path
from verispec.loader.drafts import (
    load_dflash,
    load_dspark,
    load_eagle,
    load_eagle3,
    load_medusa,
    load_mlp_speculator,
    load_mtp,
)
from verispec.loader.gguf import build_hf_config, read_gguf_header
from verispec.loader.hf import read_hf_config
from verispec.models.decoder import WholeHead
from verispec.models.dspark import merged_config
from verispec.models.eagle3 import aux_layer_ids
from verispec.proposers.base import DraftContext, Proposal, Proposer, ProposerNeeds
from verispec.proposers.custom import build_custom_proposer
from verispec.proposers.dflash import DFlashProposer
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.draft_vocab import draft_vocab_ids, special_ids
from verispec.proposers.dspark import DSparkProposer
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.extract_hidden_states import HiddenStatesExtractor, hidden_states_folder
from verispec.proposers.heads import HeadProposer
from verispec.proposers.ngram import NgramProposer
from verispec.proposers.suffix import SuffixProposer
from verispec.proposers.vocab_map import build_vocab_map, tokenizer_keys
from verispec.runner.kv_cache import KVCache
from verispec.runner.model_runner import ModelRunner
from verispec.sample.tree import DynamicTree, TokenTree
from verispec.spec_config import (
    CUSTOM_CLASS,
    MTP_MODEL_TYPES,
    TREE_METHODS,
    SpeculativeConfig,
    custom_proposer_path,
    parse_json_config,
)

__all__ = [
    "DraftContext",
    "Proposal",
    "Proposer",
    "ProposerNeeds",
    "SUPPORTED_METHODS",
    "build_proposer",
    "check_kv_transfer",
    "check_supported",
    "draft_kv_share",
    "resolve_speculative_config",
]


def _ngram(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)


def _draft_model(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    hetero = cfg.use_heterogeneous_vocab
    draft = load_checkpoint(cfg.model, ctx.device, ctx.dtype, skip_tokenizer_init=not hetero)
    tv, dv = ctx.target.config.vocab_size, draft.config.vocab_size
    if tv != dv and not hetero:
        raise ValueError(
            f"speculative_config.model {cfg.model!r} has vocab_size={dv} but the target model has {tv}; "
            "draft_model needs the same vocabulary, or use_heterogeneous_vocab: true to draft across tokenizers"
        )
    _trim_draft_head(cfg, draft, draft.tokenizer if hetero else ctx.target.tokenizer)
    # the target's precision (Q8_0 blocks for float layers, int8 activations), then the layers fused on those weights
    _follow_target_weights(draft.model, ctx)
    fuse_if_enabled(draft.model)
    vocab_map = heterogeneous_vocab_map(ctx.target, draft, cfg.model) if hetero else None
    target = ctx.target_cache
    if vocab_map is None and target is not None:
        # paged like the target's, through its block table: a request's draft K/V sit in the same block ids (the
        # positions are the same tokens), so the draft holds only the blocks its requests hold
        cache = KVCache(
            draft.config,
            ctx.num_slots,
            ctx.t_alloc,
            ctx.device,
            ctx.cache_dtype,
            target.pool.num_blocks,
            target.block_size,
        )
        cache.block_table = target.block_table
    else:
        # across vocabularies a draft position counts draft tokens: full-length slots of its own
        cache = KVCache(draft.config, ctx.num_slots, ctx.t_alloc, ctx.device, ctx.cache_dtype)
    runner = ModelRunner(draft.model, cache, ctx.device)
    keep = cfg.rejection_sample_method == "probabilistic"
    mask_token = parallel_drafting_token(draft.hf_config, dv) if cfg.parallel_drafting else None
    sample = cfg.draft_sample_method != "greedy"
    return DraftModelProposer(
        runner,
        cfg.num_speculative_tokens,
        keep,
        ctx.seed,
        mask_token,
        sample,
        vocab_map,
        target if cache.block_table is getattr(target, "block_table", None) else None,
    )


def _trim_draft_head(cfg: SpeculativeConfig, draft, tokenizer) -> None:
    """draft_vocab_size / draft_vocab_file: the draft's LM head over those ids and the tokenizer's special ones."""

    if cfg.draft_vocab_size is None and cfg.draft_vocab_file is None:
        return
    keep = draft_vocab_ids(
        draft.config.vocab_size, cfg.draft_vocab_size, cfg.draft_vocab_file, special_ids(tokenizer)
    )
    if keep is not None:
        draft.model.lm_head = trim_head(draft.model.lm_head, keep)


def heterogeneous_vocab_map(target, draft, name: str):
    """The TLI map between two loaded checkpoints' vocabularies (proposers/vocab_map.py), from their tokenizers."""

    for who, ckpt in (("target model", target), (f"speculative_config.model {name!r}", draft)):
        if ckpt.tokenizer is None:
            raise ValueError(
                f"use_heterogeneous_vocab maps token strings between the two tokenizers, but the {who} has none "
                "(skip_tokenizer_init, or no tokenizer.json in its folder)"
            )
    keys = tokenizer_keys(target.tokenizer), tokenizer_keys(draft.tokenizer)
    return build_vocab_map(*keys, target.config.vocab_size, draft.config.vocab_size)


def parallel_drafting_token(hf: dict, vocab: int) -> int:
    """The mask token a parallel draft (PARD, P-EAGLE, DFlash) fills the future slots with, from its config.json:
    vLLM's keys in vLLM's order."""
    dflash = hf.get("dflash_config") if isinstance(hf.get("dflash_config"), dict) else {}
    keys = (dflash.get("mask_token_id"), hf.get("mask_token_id"), hf.get("dspark_noise_token_id"))
    candidates = (*keys, hf.get("pard_token"), hf.get("ptd_token_id"))
    token = next((t for t in candidates if t is not None), None)
    if token is None:
        raise ValueError(
            "For parallel drafting, the draft model config must have `dflash_config.mask_token_id`, "
            "`mask_token_id`, `dspark_noise_token_id`, `pard_token`, or `ptd_token_id` specified in its config.json."
        )
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
        raise ValueError(f"parallel drafting mask token {token!r} must be a token id in [0, {vocab})")
    return token


def _suffix(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    return SuffixProposer(
        cfg.suffix_decoding_max_tree_depth,
        cfg.suffix_decoding_max_cached_requests,
        cfg.suffix_decoding_max_spec_factor,
        cfg.suffix_decoding_min_token_prob,
    )


def _head_proposer(
    cfg: SpeculativeConfig, ctx: DraftContext, heads, hidden: int, vocab: int, n: int, unit: str
):
    """Checks shared by the draft heads that read the target's hidden state, then their proposer."""

    target = ctx.target.config
    for key, mine, theirs in (
        ("hidden size", hidden, target.hidden_size),
        ("vocab_size", vocab, target.vocab_size),
    ):
        if mine != theirs:
            raise ValueError(
                f"speculative_config.model {cfg.model!r}: {key} {mine} but the target's is {theirs}"
            )
    if cfg.num_speculative_tokens > n:
        raise ValueError(
            f"num_speculative_tokens={cfg.num_speculative_tokens} but {cfg.model!r} has {n} {unit} (one draft token "
            f"each): use at most {n}"
        )
    _follow_target_weights(heads, ctx)
    return HeadProposer(heads)


def _medusa(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    heads = load_medusa(cfg.model, ctx.device, ctx.dtype)
    c = heads.cfg
    return _head_proposer(cfg, ctx, heads, c.hidden_size, c.vocab_size, c.num_heads, "heads")


def _mlp_speculator(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    model = load_mlp_speculator(cfg.model, ctx.device, ctx.dtype)
    c = model.cfg
    return _head_proposer(cfg, ctx, model, c.emb_dim, c.vocab_size, c.n_predict, "stages (n_predict)")


def _extract_hidden_states(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    if cfg.model not in (None, "extract_hidden_states"):
        raise ValueError(
            "speculative_config.model: method 'extract_hidden_states' reads the target itself; omit model"
        )
    n = ctx.target.config.num_layers
    # EAGLE-3's layers by default
    ids = cfg.eagle_aux_hidden_state_layer_ids or (2, n // 2, n - 3)
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {bad} out of range: the target has {n} layers (ids 0..{n}; id i is "
            f"the input of layer i, {n} the output of the last)"
        )
    return HiddenStatesExtractor(tuple(ids), hidden_states_folder(ctx.kv_transfer_config))


def _parallel_eagle(cfg: SpeculativeConfig, vocab: int, tree) -> int | None:
    """P-EAGLE (`parallel_drafting` with eagle / eagle3): the mask token its K - 1 extra rows are fed as; None when
    drafting autoregressively. A tree is grown level by level from the drafter's own states: chains only."""
    if not cfg.parallel_drafting:
        return None
    if tree is not None:
        raise ValueError(
            f"parallel_drafting with method '{cfg.method}' drafts a chain of num_speculative_tokens in one forward; "
            "it cannot grow a speculative_token_tree: omit one of the two keys"
        )
    return parallel_drafting_token(read_hf_config(Path(cfg.model)), vocab)


def _follow_target_weights(draft: torch.nn.Module, ctx: DraftContext) -> None:
    """A draft's float layers become Q8_0 blocks when the target runs on quantized blocks (a GGUF target kept
    quantized), as vLLM's draft follows the target's dtype, and those blocks take int8 activations whatever the
    target's activation_dtype: drafts only propose, so the output cannot change, and on every x86 CPU the int8
    kernels run a draft's small, few-row products faster than float32 ones. Only a draft with the target's own weights loses: under a float32 target its drafts no longer round
    exactly as the target does."""

    if keeps_quantized(ctx.target.model):
        quantize_dense_layers(draft)
        use_int8_activations(draft)


def _eagle(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    target = ctx.target.config
    tree = token_tree(cfg, target.vocab_size)
    mask = _parallel_eagle(cfg, target.vocab_size, tree)
    draft = load_eagle(cfg.model, ctx.device, ctx.dtype, parallel=mask is not None)
    for key, mine, theirs in (
        ("hidden_size", draft.cfg.hidden_size, target.hidden_size),
        ("vocab_size", draft.cfg.vocab_size, target.vocab_size),
    ):
        if mine != theirs:
            raise ValueError(
                f"speculative_config.model {cfg.model!r}: EAGLE {key}={mine} but the target's is {theirs}"
            )
    draft.bind_target(_shared_target(ctx))
    _follow_target_weights(draft, ctx)
    cache = KVCache(draft.cfg, ctx.num_slots, ctx.t_alloc, ctx.device, ctx.cache_dtype)
    runner = ModelRunner(draft, cache, ctx.device)
    return EagleProposer(draft, runner, tree=tree, sample_children=_samples_trees(cfg), mask_token=mask)


def _eagle3(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    target = ctx.target.config
    draft = load_eagle3(cfg.model, ctx.device, ctx.dtype, target.hidden_size, parallel=cfg.parallel_drafting)
    if draft.cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model {cfg.model!r}: EAGLE-3 vocab_size={draft.cfg.vocab_size} but the target's is "
            f"{target.vocab_size}"
        )
    layers = aux_layer_ids(read_hf_config(Path(cfg.model)), target.num_layers)
    bad = [i for i in layers if not 0 <= i <= target.num_layers]
    if len(layers) != 3 or bad:
        raise ValueError(
            f"{cfg.model}: eagle_aux_hidden_state_layer_ids {list(layers)} must be 3 layer ids in 0..{target.num_layers}"
        )
    tree = token_tree(cfg, draft.lm_head.out_features)
    mask = _parallel_eagle(cfg, target.vocab_size, tree)
    draft.bind_target(ctx.target.model)
    _follow_target_weights(draft, ctx)
    cache = KVCache(replace(draft.cfg, num_layers=1), ctx.num_slots, ctx.t_alloc, ctx.device, ctx.cache_dtype)
    runner = ModelRunner(draft, cache, ctx.device)
    return EagleProposer(draft, runner, tuple(layers), tree, _samples_trees(cfg), mask)


def _dflash(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    draft, mask = _block_draft(cfg, ctx, load_dflash, read_hf_config(Path(cfg.model)), "DFlash", 1)
    cache = KVCache(draft.cfg, ctx.num_slots, ctx.t_alloc, ctx.device, ctx.cache_dtype)
    return DFlashProposer(draft, ModelRunner(draft, cache, ctx.device), mask)


def _dspark(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    hf = merged_config(read_hf_config(Path(cfg.model)))
    arch = (hf.get("architectures") or [None])[0]
    if arch in ("Qwen3OmniDSparkModel", "Gemma4DSparkModel"):
        raise ValueError(
            f"speculative_config.model {cfg.model!r} is a {arch} draft; this build runs Qwen3 DSpark drafts "
            "(Qwen3DSparkModel)"
        )
    # the bonus-anchor layout spends a block row on the anchor, as DFlash does
    anchor_rows = 1 if hf["dflash_config"].get("dspark_bonus_anchor") else 0
    draft, mask = _block_draft(cfg, ctx, load_dspark, hf, "DSpark", anchor_rows)
    cache = KVCache(draft.cfg, ctx.num_slots, ctx.t_alloc, ctx.device, ctx.cache_dtype)
    runner = ModelRunner(draft, cache, ctx.device)
    return DSparkProposer(draft, runner, mask, cfg.dspark_confidence_threshold)


def _block_draft(cfg: SpeculativeConfig, ctx: DraftContext, load, hf: dict, what: str, anchor_rows: int):
    """A DFlash / DSpark draft loaded and bound to the target, checked against it -> (draft, mask token)."""
    target = ctx.target.config
    draft = load(cfg.model, ctx.device, ctx.dtype, target)
    c, block = draft.cfg, draft.dflash.block_size
    # the hidden size must match where the draft uses the target's embedding or LM head
    shared = draft.embed_tokens is None or draft.lm_head is None
    for key, mine, theirs in (
        ("vocab_size", c.vocab_size, target.vocab_size),
        ("hidden_size", c.hidden_size, target.hidden_size),
    ):
        if mine != theirs and (key == "vocab_size" or shared):
            raise ValueError(
                f"speculative_config.model {cfg.model!r}: {what} {key}={mine} but the target's is {theirs}"
            )
    most = block - anchor_rows
    if cfg.num_speculative_tokens > most:
        layout = f"the newest token and {block - 1} mask tokens" if anchor_rows else "the newest token first"
        raise ValueError(
            f"num_speculative_tokens={cfg.num_speculative_tokens} but {cfg.model!r} drafts blocks of block_size={block} "
            f"({layout}): use at most {most}"
        )
    mask = parallel_drafting_token(hf, target.vocab_size)
    draft.bind_target(_shared_target(ctx), mask)
    _follow_target_weights(draft, ctx)
    return draft, mask


def _shared_target(ctx: DraftContext):
    """The target whose embedding and LM head a draft head uses. Under tensor parallelism the ranks hold the head in
    shards and each call of it is a collective: rank 0 then gets a head of its own over the whole vocabulary."""
    model = ctx.target.model
    if model.tp is None:
        return model
    return WholeHead(model, read_lm_head(ctx.target.source, ctx.target.config.tie_word_embeddings))


def _mtp(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:

    target = ctx.target
    if target.config.architecture not in MTP_ARCHITECTURES:
        raise ValueError(
            f"speculative method 'mtp' drafts with the target's own MTP layers, but {target.source} is "
            f"{target.config.architecture}; MTP checkpoints this build reads: {', '.join(MTP_ARCHITECTURES)}"
        )
    if cfg.model is not None and Path(cfg.model).resolve() != Path(target.source).resolve():
        raise ValueError(
            "speculative_config.model: method 'mtp' uses the target checkpoint's MTP layers; omit model"
        )
    layer = load_mtp(target.source, target.config, ctx.device, ctx.dtype)
    layer.bind_target(_shared_target(ctx))
    cache = KVCache(
        replace(target.config, num_layers=1), ctx.num_slots, ctx.t_alloc, ctx.device, ctx.cache_dtype
    )
    return EagleProposer(
        layer,
        ModelRunner(layer, cache, ctx.device),
        tree=token_tree(cfg, target.config.vocab_size),
        sample_children=_samples_trees(cfg),
    )


MTP_ARCHITECTURES = ("MiMoForCausalLM",)


def _custom_class(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:
    """A user's proposer class by import path (vLLM's `custom_class`), checked against the Proposer protocol."""
    return build_custom_proposer(cfg.model, cfg, ctx)


@dataclass(frozen=True)
class _Method:
    """A method's builder and what the engine must set aside for it before building."""

    build: Callable[[SpeculativeConfig, DraftContext], Proposer]
    # the share of the KV memory budget the drafter's own KV cache takes (a draft model: as large as the target's)
    kv_cache_share: float = 0.0
    # writes what it captures through a kv_transfer_config connector
    kv_transfer: bool = False


_METHODS: dict[str, _Method] = {
    "ngram": _Method(_ngram),
    "draft_model": _Method(_draft_model, kv_cache_share=0.5),
    "suffix": _Method(_suffix),
    "medusa": _Method(_medusa),
    "mlp_speculator": _Method(_mlp_speculator),
    "extract_hidden_states": _Method(_extract_hidden_states, kv_transfer=True),
    "eagle": _Method(_eagle),
    "eagle3": _Method(_eagle3),
    "mtp": _Method(_mtp),
    "dflash": _Method(_dflash),
    "dspark": _Method(_dspark),
    CUSTOM_CLASS: _Method(_custom_class),
}
SUPPORTED_METHODS = tuple(_METHODS)


def _samples_trees(cfg: SpeculativeConfig) -> bool:
    """Whether a static tree's children of random requests are sampled from the drafter (draft_sample_method
    'probabilistic', the default of a branching tree under `probabilistic`: recursive rejection sampling verifies
    them); 'greedy' keeps the drafter's top-ranked children."""
    return cfg.rejection_sample_method == "probabilistic" and cfg.draft_sample_method == "probabilistic"


def token_tree(cfg: SpeculativeConfig, draft_vocab: int | None = None):
    """The configured speculative_token_tree as a TokenTree, a DynamicTree, or None when it is a chain (the
    default). With draft_vocab: every child rank must name one of the drafter's tokens."""

    if cfg.dynamic_tree:
        return DynamicTree(cfg.eagle_topk, cfg.num_draft_tokens - 1, cfg.num_speculative_tokens)
    paths = cfg.token_tree
    if not paths or (all(set(p) == {0} for p in paths) and len(paths) == max(len(p) for p in paths)):
        return None
    rank = max(p[-1] for p in paths)
    if draft_vocab is not None and rank >= draft_vocab:
        raise ValueError(
            f"speculative_token_tree: child rank {rank} (the drafter's top-{rank + 1} token) needs a vocabulary of "
            f"more than {rank} tokens; the drafter has {draft_vocab}"
        )
    return TokenTree(tuple(paths))


def check_supported(cfg: SpeculativeConfig) -> None:
    """Options this build validates but cannot honour are errors, never silently ignored."""
    depth = max((len(p) for p in cfg.token_tree), default=0)
    if depth > (cfg.num_speculative_tokens or 0):
        raise ValueError(
            f"speculative_token_tree is {depth} levels deep but num_speculative_tokens is "
            f"{cfg.num_speculative_tokens}: a step drafts at most num_speculative_tokens levels; set it to {depth}"
        )
    tree = token_tree(cfg)
    if tree is not None and cfg.method not in TREE_METHODS:
        raise ValueError(
            f"speculative_token_tree: tree drafting is supported with methods {', '.join(TREE_METHODS)}, not "
            f"'{cfg.method}'; omit the key (a chain of num_speculative_tokens={cfg.num_speculative_tokens})"
        )
    if tree is not None and cfg.rejection_sample_method not in ("strict", "probabilistic"):
        raise ValueError(
            "speculative_token_tree: trees are verified with rejection_sample_method 'strict' (the target's own pick "
            "at every node) or 'probabilistic' (recursive rejection sampling of sampled children), got "
            f"'{cfg.rejection_sample_method}'"
        )
    for key in ("enable_block_verify", "enable_entropy_verify"):
        if tree is not None and getattr(cfg, key):
            raise ValueError(
                f"speculative_token_tree: {key} applies to chains only; remove one of the two keys"
            )
    unsupported = {
        "quantization": cfg.quantization is not None,
        "revision": cfg.revision is not None,
        "code_revision": cfg.code_revision is not None,
    }
    for key, given in unsupported.items():
        if given:
            raise ValueError(
                f"speculative_config.{key} is not supported by this build yet (verispec loads local, unquantised "
                "checkpoints and verifies with the rejection_sample_method); remove the key"
            )


def build_proposer(cfg: SpeculativeConfig, ctx: DraftContext) -> Proposer:
    return _METHODS[cfg.method].build(cfg, ctx)


def draft_kv_share(cfg: SpeculativeConfig | None, target: ModelConfig | None = None) -> float:
    """The share of the KV memory budget the drafter's own cache takes (0 without one). A draft model paged through
    the target's block table holds as many blocks as the target: its share is its bytes per token over both models'
    (`target`: the target's config; without it, or across vocabularies, full-length slots take half)."""
    if cfg is None:
        return 0.0
    share = _METHODS[cfg.method].kv_cache_share
    if share == 0 or target is None or not draft_pages_with_target(cfg):
        return share
    draft = _header_config(cfg.model).kv_bytes_per_token
    return draft / (draft + target.kv_bytes_per_token)


def _header_config(model: str) -> ModelConfig:
    """A checkpoint's ModelConfig from its config.json or its GGUF header alone (no weights read)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return model_config_from_hf(read_hf_config(path), str(path))
    header = read_gguf_header(path)
    names = [t.name for t in header.tensors]
    arch = header.metadata.get("general.architecture")
    return model_config_from_hf(build_hf_config(arch, header.metadata, names, path=header.path), str(path))


def draft_pages_with_target(cfg: SpeculativeConfig | None) -> bool:
    """Whether the drafter's own cache is paged through the target's block table (False: it holds full-length
    slots, so the engine keeps no more slots than fit whole)."""
    return cfg is not None and _METHODS[cfg.method].kv_cache_share > 0 and not cfg.use_heterogeneous_vocab


def check_kv_transfer(cfg: SpeculativeConfig | None, kv_transfer_config: Mapping[str, Any] | None) -> None:
    """A kv_transfer_config only with a method that writes through a connector."""
    if kv_transfer_config is not None and (cfg is None or not _METHODS[cfg.method].kv_transfer):
        names = [m for m, e in _METHODS.items() if e.kv_transfer]
        raise ValueError(
            f"kv_transfer_config is only supported with speculative_config method {', '.join(map(repr, names))} "
            "(the hidden-states connector)"
        )


def _draft_hf_config(spec: Mapping[str, Any]) -> dict | None:
    """Read the draft's config (method inference, n_predict) without loading its weights where possible."""

    model = spec.get("model")
    if not isinstance(model, str) or model in ("ngram", "[ngram]"):
        return None
    # a custom_class proposer's import path names no checkpoint
    if spec.get("method") == CUSTOM_CLASS or (spec.get("method") is None and custom_proposer_path(model)):
        return None
    if model not in ALIASES and not Path(model).expanduser().exists():
        raise ValueError(f"speculative_config.model {model!r} not found: pass an HF folder or a .gguf file")
    path = resolve_model_path(model)
    return read_hf_config(path) if path.is_dir() else None


def _existing_folder_is_a_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
    """Without `method`, a `model` that reads as an import path selects custom_class (as in vLLM); a local folder or
    file of that name ("drafts.v2") is a checkpoint instead, so it is spelled as a path."""
    model = spec.get("model")
    if spec.get("method") is None and custom_proposer_path(model) and Path(model).expanduser().exists():
        return {**spec, "model": f"./{model}"}
    return spec


def resolve_speculative_config(
    speculative_config: Mapping[str, Any] | str | None,
    target_max_model_len: int,
    target_hf_config: dict | None = None,
    target_model: str | None = None,
    target_tensor_parallel_size: int = 1,
) -> SpeculativeConfig | None:
    """The user's speculative_config (a dict or a JSON string) validated and resolved as vLLM does, and checked
    against what this build supports; ValueError naming the key otherwise. Without `model`, a method with a draft
    shipped for `target_model` (verispec/drafts) uses it."""
    if speculative_config is None:
        return None
    speculative_config = _existing_folder_is_a_checkpoint(parse_json_config(speculative_config))
    if speculative_config.get("model") is None:
        shipped = shipped_draft(target_model, speculative_config.get("method"))
        if shipped is not None:
            speculative_config = {**speculative_config, "model": shipped}
    if speculative_config.get("model"):
        draft_hf = _draft_hf_config(speculative_config)
    elif speculative_config.get("method") in ("mtp", *MTP_MODEL_TYPES):
        # no model: an MTP method drafts with the target's own layers (its config gives n_predict), as in vLLM
        draft_hf = target_hf_config
    else:
        draft_hf = None
    spec = SpeculativeConfig.from_dict(
        speculative_config,
        target_max_model_len=target_max_model_len,
        target_tensor_parallel_size=target_tensor_parallel_size,
        draft_hf_config=draft_hf,
        supported_methods=SUPPORTED_METHODS,
    )
    check_supported(spec)
    return spec
