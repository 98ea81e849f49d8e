"""Speculative decoding config: vLLM's ``--speculative-config`` keys, defaults, rules and error messages.

``SpeculativeConfig.from_dict`` / ``from_json`` validate a user's config and return a new, resolved, frozen
config. Pure: no file I/O, no torch; the caller loads the draft's config.json and passes it as ``draft_hf_config``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import logging
import math
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# vLLM's MTP_MODEL_TYPES: deprecated method names (each becomes "mtp" with a warning) and MTP draft model_types.
MTP_MODEL_TYPES = tuple(
    "deepseek_mtp mimo_mtp glm4_moe_mtp ernie_mtp qwen3_next_mtp longcat_flash_mtp pangu_ultra_moe_mtp".split()
)
NGRAM_METHODS = ("ngram", "ngram_gpu")
# Methods without draft weights; `model` defaults to the method name, as in vLLM.
MODEL_FREE_METHODS = ("ngram", "ngram_gpu", "suffix", "extract_hidden_states")
# Methods that need `model`: a draft model, EAGLE head or extra weights.
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "dflash", "dspark", "medusa", "mlp_speculator")
# Methods with draft weights; "mtp" without `model` uses the target checkpoint's own MTP layers.
DRAFT_WEIGHT_METHODS = (*MODEL_METHODS, "mtp")
# vLLM's plugin method: `model` is the import path of a user's proposer class (proposers/base.py's protocol)
CUSTOM_CLASS = "custom_class"
SPECULATIVE_METHODS = (*MODEL_FREE_METHODS, *DRAFT_WEIGHT_METHODS, CUSTOM_CLASS)
PARALLEL_DRAFTING_METHODS = ("eagle", "eagle3", "dflash", "dspark", "draft_model")
# draft architectures vLLM resolves to method "dspark" (DeepSeek-V4's own DSpark layers are its MTP-style drafts)
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "Qwen3OmniDSparkModel", "Gemma4DSparkModel")
REJECTION_SAMPLE_METHODS = ("strict", "probabilistic", "synthetic")
# Current vLLM's spellings: "standard" is Leviathan / Chen speculative sampling (this build's "probabilistic"),
# "block" is Block Verification (Sun et al.): "probabilistic" with enable_block_verify.
REJECTION_SAMPLE_ALIASES = {"standard": "probabilistic", "block": "probabilistic"}
# vLLM's draft_sample_method: "greedy" drafts the argmax (q one-hot at the draft); "probabilistic" samples drafts
# from the draft distribution and keeps it for probabilistic verification.
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
# Methods whose drafter has a draft distribution to sample from; the others draft deterministically.
DRAFT_SAMPLING_METHODS = ("draft_model",)
# Methods that draft token trees; under `probabilistic` a branching tree's children may be sampled from the
# drafter's distribution (draft_sample_method 'probabilistic', their default there).
TREE_METHODS = ("eagle", "eagle3", "mtp")

# vLLM's hf_config_override: checkpoints whose MTP layers make them drafts of model_type *_mtp.
_MTP_MODEL_TYPE_OVERRIDES = {"deepseek_v3": "deepseek_mtp", "deepseek_v32": "deepseek_mtp"}
_MTP_MODEL_TYPE_OVERRIDES |= {"ernie4_5_moe": "ernie_mtp", "qwen3_next": "qwen3_next_mtp"}
_MTP_MODEL_TYPE_OVERRIDES |= {"longcat_flash": "longcat_flash_mtp", "pangu_ultra_moe": "pangu_ultra_moe_mtp"}
_MTP_ARCH_OVERRIDES = {"MiMoForCausalLM": "mimo_mtp", "Glm4MoeForCausalLM": "glm4_moe_mtp"}
# config.json keys a model's maximum length is read from (the smallest present wins, as in vLLM).
_MAX_LEN_KEYS = (
    "max_position_embeddings n_positions max_seq_len seq_length model_max_length max_sequence_length "
    "max_seq_length seq_len"
).split()
# vLLM fields the engine populates; never user keys.
_INTERNAL_KEYS = (
    "target_model_config target_parallel_config draft_parallel_config draft_load_config "
    "enable_chunked_prefill disable_log_stats"
).split()
_AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"
_NO_MODEL = "num_speculative_tokens was provided but without speculative model"
# drafted tokens one step may verify per request (vLLM sets no bound)
MAX_SPECULATIVE_TOKENS = 1024
# speculative_token_tree's value for EAGLE-2 dynamic trees, and their default sizes
DYNAMIC_TREE = "dynamic"
DYNAMIC_TOPK = 4
DYNAMIC_NUM_DRAFT_TOKENS = 16
# Range rules: key -> (check, rule in vLLM's message style).
_BOUNDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_model_len": (lambda v: v is None or v >= 1, "must be >= 1"),
    "suffix_decoding_max_tree_depth": (lambda v: v >= 1, "must be >= 1"),
    "suffix_decoding_max_cached_requests": (lambda v: v >= 0, "must be >= 0"),
    "suffix_decoding_max_spec_factor": (lambda v: v >= 0, "must be >= 0"),
    "suffix_decoding_min_token_prob": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "posterior_threshold": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "posterior_alpha": (lambda v: v >= 0, "must be >= 0"),
    "dspark_confidence_threshold": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Expected type of a user key -> (name for messages, check).
_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an int", _is_int),
    "float": ("a finite float", lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v)),
    "bool": ("a bool", lambda v: isinstance(v, bool)),
    "str": ("a str", lambda v: isinstance(v, str)),
    "tree": ("a str or a list of tuples of ints", lambda v: isinstance(v, (str, list, tuple))),
    "mapping": ("a mapping", lambda v: isinstance(v, Mapping)),
    # each entry's shape is checked by _check_schedule, with vLLM's messages
    "schedule": (
        "a list of [start_bs, end_bs, num_speculative_tokens] entries",
        lambda v: isinstance(v, (list, tuple)),
    ),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """A resolved speculative decoding config. Build it with ``from_dict`` / ``from_json``."""

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    draft_tensor_parallel_size: int | None = None
    # resolved: the draft's effective max length
    max_model_len: int | None = None
    quantization: str | None = None
    revision: str | None = None
    code_revision: str | None = None
    enforce_eager: bool | None = None
    disable_by_batch_size: int | None = None
    # vLLM's fixed schedule: [[start_bs, end_bs, K], ...], K drafts at batch sizes start_bs..end_bs (0: none); a
    # batch size between two ranges (or past the last) takes the previous range's K, and a K above
    # num_speculative_tokens is clamped to it (planner/goodput.py schedule_cap); stored sorted, as tuples
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    # the goodput planner (planner/goodput.py) picks each step's draft lengths, num_speculative_tokens being the cap;
    # on by default in verispec (false: every step drafts the fixed K, as vLLM)
    enable_adaptive_verification: bool = True
    disable_padded_drafter_batch: bool = False
    # vLLM drops the last cached block of an EAGLE-family prefix hit (its drafter would lack the states there);
    # verispec keeps every cached position's state beside its K/V (runner/state_pool.py) and never drops it, so true
    # and false run alike here
    disable_eagle_block_drop: bool = False
    disable_logprobs: bool = True
    # resolved: 0 for non-ngram methods, as in vLLM
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # resolved: str(list of tuples), sorted breadth-first; or "dynamic" (verispec: EAGLE-2 dynamic trees, per
    # request and step, num_speculative_tokens levels deep)
    speculative_token_tree: str | None = None
    # dynamic trees only (SGLang's speculative_eagle_topk / speculative_num_draft_tokens): children per expanded node
    # and nodes expanded per level; nodes verified per request, the root (newest committed token) included
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    parallel_drafting: bool = False
    # cross-tokenizer drafting (TLI): the draft model has its own vocabulary; it proposes only tokens both
    # vocabularies hold, mapped to the target's ids (method draft_model only)
    use_heterogeneous_vocab: bool = False
    # verispec: the draft model's LM head computes only these token ids (FR-Spec, VocabTrim):
    # ids 0 .. N-1, or a file of little-endian int32 ids; the special ids are always kept (method draft_model only)
    draft_vocab_size: int | None = None
    draft_vocab_file: str | None = None
    rejection_sample_method: str = "strict"
    synthetic_acceptance_rate: float | None = None
    # resolved: "probabilistic" for methods with a draft distribution (this build's behaviour: random requests
    # draft samples), "greedy" for the others (vLLM's default is "greedy" everywhere)
    draft_sample_method: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Block / Entropy Verify (vLLM Ascend's rejection_sampler_config, flattened into this config).
    enable_block_verify: bool = False
    enable_entropy_verify: bool = False
    posterior_threshold: float = 0.95
    posterior_alpha: float = 0.4
    # DSpark: a block's drafts are cut where the product of its confidence head's estimates falls below this
    # (0: every draft; the goodput planner reads the estimates either way)
    dspark_confidence_threshold: float = 0.0
    # Given as draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids (extract_hidden_states only).
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] | None = None

    @classmethod
    def from_dict(
        cls,
        config: Mapping[str, Any],
        *,
        target_max_model_len: int | None = None,
        target_tensor_parallel_size: int = 1,
        draft_hf_config: Mapping[str, Any] | None = None,
        supported_methods: Collection[str] | None = None,
    ) -> SpeculativeConfig:
        """Validate ``config`` (never mutated) and return a new, resolved config."""
        _check_target(target_max_model_len, target_tensor_parallel_size)
        user = _parse_user_dict(config)
        values = {f.name: f.default for f in dataclasses.fields(cls)} | user
        _resolve_rejection_alias(values, user)
        draft = _DraftInfo.parse(draft_hf_config)
        values["method"] = _resolve_method(values, draft, supported_methods)
        _resolve_method_keys(values, draft)
        _resolve_sizes(values, draft, target_max_model_len, target_tensor_parallel_size)
        _check_ranges(values)
        return cls(**values)

    @classmethod
    def from_json(cls, text: str, **kwargs: Any) -> SpeculativeConfig:
        """``from_dict`` for a JSON object string, as given to ``--speculative-config``; same kwargs."""
        return cls.from_dict(parse_json_config(text), **kwargs)

    @property
    def num_lookahead_slots(self) -> int:
        """Extra KV slots per step: one per position a step scores beyond the committed token (each speculative
        token, or every node of a token tree)."""
        nodes = self.num_draft_tokens - 1 if self.dynamic_tree else len(self.token_tree)
        return max(self.num_speculative_tokens or 0, nodes)

    @property
    def dynamic_tree(self) -> bool:
        return self.speculative_token_tree == DYNAMIC_TREE

    @property
    def token_tree(self) -> list[tuple[int, ...]]:
        """The parsed ``speculative_token_tree``, in breadth-first order ([] for a dynamic tree)."""
        if not self.speculative_token_tree or self.dynamic_tree:
            return []
        return ast.literal_eval(self.speculative_token_tree)

    def to_dict(self) -> dict[str, Any]:
        """User-facing keys with resolved values; JSON-serialisable and accepted back by ``from_dict``."""
        out = dataclasses.asdict(self)
        layer_ids = out.pop(_AUX_LAYERS_KEY)
        if layer_ids is not None:
            out["draft_model_config"] = {"hf_config": {_AUX_LAYERS_KEY: list(layer_ids)}}
        return out


def parse_json_config(config: str | Mapping[str, Any], name: str = "speculative_config") -> dict[str, Any]:
    """A config given as a JSON string (``--speculative-config``) or a mapping (a dict, a YAML file's value) ->
    dict, or a clear ValueError naming `name`. Every command and `LLM(...)` parse these configs here."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(config, Mapping):
        raise ValueError(f"{name} must be a mapping (JSON object), got {type(config).__name__}")
    return dict(config)


def _user_key_types() -> dict[str, tuple[str, bool]]:
    """User key -> (expected type, null allowed): the field's annotation; null where the default is None."""
    fields = dataclasses.fields(SpeculativeConfig)
    types = {f.name: (str(f.type).split(" | ")[0], f.default is None) for f in fields}
    del types[_AUX_LAYERS_KEY]
    return types | {
        "speculative_token_tree": ("tree", True),
        "draft_model_config": ("mapping", True),
        "num_speculative_tokens_per_batch_size": ("schedule", True),
    }


_KEY_TYPES = _user_key_types()
ALLOWED_KEYS = frozenset(_KEY_TYPES)


@dataclass(frozen=True)
class _DraftInfo:
    """What the draft's config.json tells us, after vLLM's hf_config_override."""

    model_type: str | None = None
    n_predict: int | None = None
    max_model_len: int | None = None
    architecture: str | None = None

    @classmethod
    def parse(cls, hf: Mapping[str, Any] | None) -> _DraftInfo:
        if hf is None:
            return cls()
        if not isinstance(hf, Mapping):
            raise ValueError(f"draft_hf_config must be a mapping (config.json), got {type(hf).__name__}")
        model_type = hf.get("model_type") if isinstance(hf.get("model_type"), str) else None
        archs = hf.get("architectures") or [None]
        arch = archs[0] if isinstance(archs, list) and isinstance(archs[0], str) else None
        mtp_type = _MTP_MODEL_TYPE_OVERRIDES.get(model_type or "") or _MTP_ARCH_OVERRIDES.get(arch or "")
        n_predict = hf.get("n_predict")
        if mtp_type or model_type in MTP_MODEL_TYPES:
            model_type = mtp_type or model_type
            default = 1 if model_type == "longcat_flash_mtp" else n_predict
            n_predict = hf.get("num_nextn_predict_layers", default)
        if n_predict is not None and not (_is_int(n_predict) and n_predict > 0):
            raise ValueError(f"draft_hf_config n_predict={n_predict!r} must be a positive int")
        lengths = [hf[k] for k in _MAX_LEN_KEYS if _is_int(hf.get(k)) and hf[k] > 0]
        return cls(model_type, n_predict, min(lengths) if lengths else None, arch)


def _check_target(max_model_len: int | None, tensor_parallel_size: int) -> None:
    if max_model_len is not None and not (_is_int(max_model_len) and max_model_len >= 1):
        raise ValueError(f"target_max_model_len={max_model_len!r} must be an int >= 1")
    if not (_is_int(tensor_parallel_size) and tensor_parallel_size >= 1):
        raise ValueError(f"target_tensor_parallel_size={tensor_parallel_size!r} must be an int >= 1")


def _parse_user_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    """Reject misplaced / unknown keys and wrongly typed values; return a new dict of the given keys."""
    if not isinstance(config, Mapping):
        raise ValueError(f"speculative_config must be a mapping (JSON object), got {type(config).__name__}")
    if "tensor_parallel_size" in config:
        raise ValueError(
            "'tensor_parallel_size' is not a valid argument in the speculative_config. "
            "Please pass 'draft_tensor_parallel_size' instead."
        )
    for key in _INTERNAL_KEYS:
        if key in config:
            raise ValueError(f"'{key}' is populated internally and cannot be set in speculative_config")
    unknown = [key for key in config if key not in ALLOWED_KEYS]
    if unknown:
        names = ", ".join(repr(key) for key in unknown)
        close = [m for key in unknown for m in difflib.get_close_matches(str(key), ALLOWED_KEYS, n=1)]
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        allowed = ", ".join(sorted(ALLOWED_KEYS))
        raise ValueError(f"Unknown key(s) {names} in speculative_config{hint}. Allowed keys: {allowed}")
    return {key: _coerce(key, value) for key, value in config.items()}


def _coerce(key: str, value: Any) -> Any:
    kind, nullable = _KEY_TYPES[key]
    type_name, check = _TYPES[kind]
    if value is None and nullable:
        return None
    if check(value):
        return float(value) if kind == "float" else value
    expected = type_name + (" or null" if nullable else "")
    raise ValueError(f"speculative_config key '{key}' must be {expected}, got {value!r}")


def _resolve_method(values: dict[str, Any], draft: _DraftInfo, supported: Collection[str] | None) -> str:
    method = _normalize_method(values["method"], values["model"], values["num_speculative_tokens"], draft)
    if supported is not None and method not in supported:
        raise ValueError(
            f"speculative method '{method}' is not supported by this build yet; "
            f"supported methods: {', '.join(sorted(supported))}"
        )
    if method == "mtp" and draft.model_type is not None and draft.model_type not in MTP_MODEL_TYPES:
        raise ValueError(
            f"method 'mtp' needs a checkpoint with MTP layers, but the draft model_type is "
            f"'{draft.model_type}' (MTP model types: {', '.join(MTP_MODEL_TYPES)})"
        )
    return method


def _normalize_method(method: str | None, model: str | None, n: int | None, draft: _DraftInfo) -> str:
    if method is None:
        if model is None:
            detail = "" if n is None else f" ({_NO_MODEL})"
            raise ValueError(f"speculative_config must set `method` or `model`{detail}")
        return _infer_method(model, draft)
    if method == "[ngram]":
        return "ngram"
    if method in MTP_MODEL_TYPES:
        warnings.warn(f"method `{method}` is deprecated and replaced with mtp.", FutureWarning, stacklevel=4)
        return "mtp"
    if method not in SPECULATIVE_METHODS:
        aliases = ", ".join(("[ngram]", *MTP_MODEL_TYPES))
        raise ValueError(
            f"Unknown speculative method '{method}'. Valid methods: {', '.join(SPECULATIVE_METHODS)} "
            f"(deprecated aliases: {aliases})"
        )
    return method


_CHECKPOINT_SUFFIXES = frozenset("gguf safetensors bin pt pth json".split())


def custom_proposer_path(model: str | None) -> tuple[str, str] | None:
    """`model` as the import path of a proposer class -> (module, class name), else None: vLLM's dotted form
    "package.module.ClassName" (no "/", every part an identifier), or "package.module:ClassName"."""
    if not isinstance(model, str) or "/" in model:
        return None
    module, colon, name = model.rpartition(":")
    if not colon:
        module, _, name = model.rpartition(".")
    parts = [*module.split("."), name]
    # "draft.gguf" is a checkpoint file, not class gguf of module draft
    if not module or name in _CHECKPOINT_SUFFIXES or not all(part.isidentifier() for part in parts):
        return None
    return module, name


def _infer_method(model: str, draft: _DraftInfo) -> str:
    """vLLM's detection from the model name and the draft's (overridden) model_type and architecture."""
    draft_model_type = draft.model_type
    if custom_proposer_path(model) is not None:
        return CUSTOM_CLASS
    if model in ("ngram", "[ngram]"):
        return "ngram"
    dspark = draft.architecture in DSPARK_ARCHITECTURES
    dspark |= draft.architecture == "DSparkDraftModel" and draft.model_type == "qwen3"
    for marker, method in (
        ("eagle-", "eagle"),
        ("eagle3", "eagle3"),
        ("dspark", "dspark"),
        ("dflash", "dflash"),
    ):
        if marker in model.lower() or (method == "dspark" and dspark):
            return method
    if draft_model_type in ("medusa", "mlp_speculator"):
        return draft_model_type
    return "mtp" if draft_model_type in MTP_MODEL_TYPES else "draft_model"


def _resolve_method_keys(values: dict[str, Any], draft: _DraftInfo) -> None:
    """Resolve model, ngram bounds, num_speculative_tokens and the token tree for the resolved method."""
    method = values["method"]
    if method in ("dflash", "dspark"):
        # as in vLLM: a DFlash / DSpark draft always drafts its block in parallel
        values["parallel_drafting"] = True
    if values["dspark_confidence_threshold"] and method != "dspark":
        raise ValueError("dspark_confidence_threshold is only supported by DSpark (method 'dspark')")
    values[_AUX_LAYERS_KEY] = _aux_layer_ids(values.pop("draft_model_config", None), method)
    values["model"] = _resolve_model(method, values["model"], values["num_speculative_tokens"])
    lookup = _resolve_prompt_lookup(method, values["prompt_lookup_min"], values["prompt_lookup_max"])
    values["prompt_lookup_min"], values["prompt_lookup_max"] = lookup
    _check_bounds(values)
    num_tokens = values["num_speculative_tokens"] = _resolve_num_tokens(method, values, draft)
    values["speculative_token_tree"] = _resolve_tree(values["speculative_token_tree"], num_tokens)
    _resolve_dynamic_tree(values)


def _aux_layer_ids(draft_model_config: Mapping[str, Any] | None, method: str) -> tuple[int, ...] | None:
    if draft_model_config is None:
        return None
    hf = draft_model_config.get("hf_config", {})
    bad_hf = not isinstance(hf, Mapping) or set(hf) - {_AUX_LAYERS_KEY}
    if method != "extract_hidden_states" or set(draft_model_config) - {"hf_config"} or bad_hf:
        raise ValueError(
            "'draft_model_config' is populated internally; speculative_config accepts it only for method "
            f"'extract_hidden_states', as {{'hf_config': {{'{_AUX_LAYERS_KEY}': [<layer ids>]}}}}"
        )
    layer_ids = hf.get(_AUX_LAYERS_KEY)
    if layer_ids is None:
        return None
    if not isinstance(layer_ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in layer_ids):
        raise ValueError(f"{_AUX_LAYERS_KEY}={layer_ids!r} must be a list of layer indices >= 0")
    return tuple(layer_ids)


def _resolve_model(method: str, model: str | None, num_tokens: int | None) -> str | None:
    if method == CUSTOM_CLASS and custom_proposer_path(model) is None:
        raise ValueError(
            "method='custom_class' requires 'model' to contain the custom proposer module path (e.g., "
            f"'my_module.MyProposer' or 'my_module:MyProposer'), got model={model!r}"
        )
    if (model is not None and model != "[ngram]") or method == "mtp":
        return model
    if method in MODEL_FREE_METHODS:
        return method
    prefix = "" if num_tokens is None else f"{_NO_MODEL}. "
    raise ValueError(f"{prefix}Speculative method '{method}' requires `model` (draft model / EAGLE head).")


def _resolve_prompt_lookup(method: str, lookup_min: int | None, lookup_max: int | None) -> tuple[int, int]:
    if method not in NGRAM_METHODS:
        return 0, 0
    if lookup_min is None and lookup_max is None:
        lookup_min = lookup_max = 5
    lookup_min = lookup_max if lookup_min is None else lookup_min
    lookup_max = lookup_min if lookup_max is None else lookup_max
    assert lookup_min is not None and lookup_max is not None
    if lookup_min < 1:
        raise ValueError(f"prompt_lookup_min={lookup_min} must be > 0")
    if lookup_max < 1:
        raise ValueError(f"prompt_lookup_max={lookup_max} must be > 0")
    if lookup_min > lookup_max:
        raise ValueError(f"prompt_lookup_min={lookup_min} must be <= prompt_lookup_max={lookup_max}")
    return lookup_min, lookup_max


def _resolve_num_tokens(method: str, values: dict[str, Any], draft: _DraftInfo) -> int:
    num_tokens = values["num_speculative_tokens"]
    if method == "suffix" and num_tokens is None:
        num_tokens = values["suffix_decoding_max_tree_depth"]
        logger.warning("Defaulted num_speculative_tokens to %s for suffix decoding.", num_tokens)
    if method == "extract_hidden_states" and num_tokens not in (None, 1):
        raise ValueError(f"extract_hidden_states requires num_speculative_tokens=1, got {num_tokens}")
    num_tokens = 1 if method == "extract_hidden_states" else num_tokens
    n_predict = draft.n_predict if method in DRAFT_WEIGHT_METHODS else None
    if n_predict is not None and num_tokens is None:
        # default to the max value defined in the draft model config
        num_tokens = n_predict
    elif n_predict is not None and num_tokens > n_predict and num_tokens % n_predict != 0:
        raise ValueError(f"num_speculative_tokens:{num_tokens} must be divisible by {n_predict=}")
    if num_tokens is None:
        raise ValueError(
            "num_speculative_tokens must be provided with speculative model unless "
            "the draft model config contains an n_predict parameter."
        )
    if num_tokens <= 0:
        raise ValueError(f"Expected num_speculative_tokens to be greater than zero ({num_tokens}).")
    # the default chain tree alone grows as k^2
    if num_tokens > MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"num_speculative_tokens={num_tokens} is more than this build verifies per step "
            f"(1..{MAX_SPECULATIVE_TOKENS})."
        )
    if method == "mtp" and num_tokens > (n_predict or 1):
        logger.warning("num_speculative_tokens > 1 reruns the same MTP layer; acceptance may be lower")
    return num_tokens


def _resolve_tree(tree: str | list[Any] | tuple[Any, ...] | None, num_tokens: int) -> str:
    """A chain of ``num_tokens`` by default; "dynamic"; else the parsed tree sorted breadth-first."""
    if tree is None:
        return str([(i + 1) * (0,) for i in range(num_tokens)])
    if tree == DYNAMIC_TREE:
        return tree
    return str(sorted(_parse_tree(tree), key=lambda t: (len(t), t)))


def _resolve_dynamic_tree(values: dict[str, Any]) -> None:
    """eagle_topk / num_draft_tokens: defaults for a dynamic tree, errors without one."""
    keys = ("eagle_topk", "num_draft_tokens")
    if values["speculative_token_tree"] != DYNAMIC_TREE:
        for key in keys:
            if values[key] is not None:
                raise ValueError(f"{key} sizes dynamic trees: it needs speculative_token_tree 'dynamic'")
        return
    topk = values["eagle_topk"] = DYNAMIC_TOPK if values["eagle_topk"] is None else values["eagle_topk"]
    if values["num_draft_tokens"] is None:
        values["num_draft_tokens"] = DYNAMIC_NUM_DRAFT_TOKENS
    if topk < 1:
        raise ValueError(f"eagle_topk={topk} must be >= 1")
    if not 2 <= values["num_draft_tokens"] <= MAX_SPECULATIVE_TOKENS + 1:
        raise ValueError(
            f"num_draft_tokens={values['num_draft_tokens']} must be in [2, {MAX_SPECULATIVE_TOKENS + 1}] (the root "
            "and at least one drafted node)"
        )


def _parse_tree(tree: str | list[Any] | tuple[Any, ...]) -> list[tuple[int, ...]]:
    example = "e.g. '[(0,), (1,), (0, 0)]' or 'dynamic'"
    if isinstance(tree, str):
        try:
            tree = ast.literal_eval(tree)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
            raise ValueError(f"speculative_token_tree could not be parsed ({e}); {example}") from None
    if not isinstance(tree, (list, tuple)) or not tree:
        raise ValueError(f"speculative_token_tree must be a non-empty list of tuples, {example}")
    choices: list[tuple[int, ...]] = []
    for node in tree:
        if not isinstance(node, (list, tuple)) or not node or not all(_is_int(i) and i >= 0 for i in node):
            raise ValueError(f"speculative_token_tree node {node!r} must be a non-empty tuple of ints >= 0")
        choices.append(tuple(node))
    if len(set(choices)) != len(choices):
        raise ValueError(f"speculative_token_tree has duplicate nodes: {tree!r}")
    for node in choices:
        if len(node) > 1 and node[:-1] not in choices:
            raise ValueError(f"speculative_token_tree node {node} has no parent {node[:-1]}")
    return choices


def _resolve_sizes(values: dict[str, Any], draft: _DraftInfo, target_len: int | None, target_tp: int) -> None:
    method, draft_tp = values["method"], values["draft_tensor_parallel_size"]
    values["draft_tensor_parallel_size"] = _resolve_draft_tp(draft_tp, method, target_tp)
    draft_len = draft.max_model_len if method in DRAFT_WEIGHT_METHODS else None
    values["max_model_len"] = _resolve_max_model_len(values["max_model_len"], draft_len, target_len)


def _resolve_draft_tp(draft_tp: int | None, method: str, target_tp: int) -> int | None:
    """vLLM's _verify_and_get_draft_tp: 1 or the target's; defaults to the target's (1 for mlp_speculator)."""
    speculative_draft_tensor_parallel_size = draft_tp
    if draft_tp is not None and draft_tp not in (1, target_tp):
        raise ValueError(
            f"{speculative_draft_tensor_parallel_size=} cannot be "
            "other value than 1 or target model tensor_parallel_size"
        )
    if draft_tp is not None or method not in DRAFT_WEIGHT_METHODS:
        return draft_tp
    if method == "mlp_speculator":
        if target_tp > 1:
            logger.warning("mlp_speculator cannot run with tp>1; setting draft_tensor_parallel_size=1")
        return 1
    return target_tp


def _resolve_max_model_len(
    speculative_max_model_len: int | None, draft_max_model_len: int | None, target_max_model_len: int | None
) -> int | None:
    """vLLM's _maybe_override_draft_max_model_len: the user's value if it fits both, else the smaller."""
    if speculative_max_model_len is None:
        known = [n for n in (draft_max_model_len, target_max_model_len) if n is not None]
        return min(known) if known else None
    if draft_max_model_len is not None and speculative_max_model_len > draft_max_model_len:
        raise ValueError(f"{speculative_max_model_len=} cannot be larger than {draft_max_model_len=}")
    if target_max_model_len is not None and speculative_max_model_len > target_max_model_len:
        raise ValueError(f"{speculative_max_model_len=} cannot be larger than {target_max_model_len=}")
    return speculative_max_model_len


def _check_ranges(values: dict[str, Any]) -> None:
    disable_by_batch_size = values["disable_by_batch_size"]
    if disable_by_batch_size is not None and disable_by_batch_size < 2:
        raise ValueError(
            "Expect the batch size threshold of disabling speculative decoding is > 1, "
            f"but got {disable_by_batch_size=}"
        )
    values["num_speculative_tokens_per_batch_size"] = _check_schedule(
        values["num_speculative_tokens_per_batch_size"]
    )
    if values["parallel_drafting"] and values["method"] not in PARALLEL_DRAFTING_METHODS:
        raise ValueError(
            f"parallel_drafting is only compatible with EAGLE and draft-model methods "
            f"({', '.join(PARALLEL_DRAFTING_METHODS)}), got method '{values['method']}'"
        )
    if values["use_heterogeneous_vocab"] and values["method"] != "draft_model":
        raise ValueError(
            "use_heterogeneous_vocab only works with method='draft_model' (a draft model with its own "
            f"tokenizer), got method='{values['method']}'; remove the key or set it to false"
        )
    _check_draft_vocab(values)
    _check_rejection_sampling(values)


def _check_draft_vocab(values: dict[str, Any]) -> None:
    size, path = values["draft_vocab_size"], values["draft_vocab_file"]
    if size is None and path is None:
        return
    key = "draft_vocab_size" if size is not None else "draft_vocab_file"
    if values["method"] != "draft_model":
        raise ValueError(
            f"{key} trims a draft model's LM head and only works with method='draft_model', "
            f"got method='{values['method']}'; remove the key"
        )
    if size is not None and path is not None:
        raise ValueError("set one of draft_vocab_size and draft_vocab_file, not both")
    if size is not None and size < 1:
        raise ValueError(
            f"draft_vocab_size must be a positive int (the token ids the draft keeps), got {size}"
        )


def _check_schedule(schedule: Any) -> tuple[tuple[int, int, int], ...] | None:
    """num_speculative_tokens_per_batch_size, validated as vLLM does (and with its messages): a non-empty list of
    [start_bs, end_bs, K] entries, positive non-overlapping ranges, the first starting at batch size 1, K >= 0. A K
    above num_speculative_tokens is not an error: it is clamped where the schedule is applied."""
    if schedule is None:
        return None
    key = "num_speculative_tokens_per_batch_size"
    if not schedule:
        raise ValueError(f"{key} must not be empty.")
    for entry in schedule:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(_is_int(x) for x in entry)):
            raise ValueError(
                f"Each {key} entry must be a 3-item sequence (range_start, range_end, num_speculative_tokens) of "
                f"ints, got {entry!r}."
            )
        start, end, k = entry
        if start <= 0 or end <= 0:
            raise ValueError(f"{key}: Batch-size range ({start}, {end}) must be positive.")
        if start > end:
            raise ValueError(f"{key}: Batch-size range start must be <= end for ({start}, {end}, {k}).")
        if k < 0:
            raise ValueError(f"{key} K values must be >= 0, got ({start}, {end}, {k}).")
    ranges = tuple(sorted(tuple(entry) for entry in schedule))
    for (_, prev_end, _), (start, _, _) in zip(ranges, ranges[1:]):
        if start <= prev_end:
            raise ValueError(f"{key}: Batch-size ranges must be non-overlapping and sorted.")
    if ranges[0][0] != 1:
        raise ValueError(
            f"{key}: The first batch-size range must start at 1 so every runtime batch size has a defined "
            "schedule."
        )
    return ranges


def _resolve_rejection_alias(values: dict[str, Any], user: Mapping[str, Any]) -> None:
    """vLLM's newer rejection_sample_method spellings -> this build's: 'standard' -> 'probabilistic', 'block' ->
    'probabilistic' with enable_block_verify (an explicit enable_block_verify=false contradicts it)."""
    method = values["rejection_sample_method"]
    if method not in REJECTION_SAMPLE_ALIASES:
        return
    if method == "block":
        if user.get("enable_block_verify") is False:
            raise ValueError(
                "rejection_sample_method 'block' is Block Verification, but enable_block_verify is false; "
                "remove enable_block_verify or use rejection_sample_method 'standard'"
            )
        values["enable_block_verify"] = True
    values["rejection_sample_method"] = REJECTION_SAMPLE_ALIASES[method]


def _samples_tree_children(values: dict[str, Any]) -> bool:
    """A branching static tree of a tree method under `probabilistic`: its children can be drawn from the
    drafter's distribution without replacement and verified by recursive rejection sampling."""
    tree = values["speculative_token_tree"]
    if values["method"] not in TREE_METHODS or values["rejection_sample_method"] != "probabilistic":
        return False
    if not isinstance(tree, str) or tree == DYNAMIC_TREE:
        return False
    return any(any(path) for path in ast.literal_eval(tree))


def _resolve_draft_sample_method(values: dict[str, Any]) -> str:
    method, draft_sample = values["method"], values["draft_sample_method"]
    can_sample = method in DRAFT_SAMPLING_METHODS or _samples_tree_children(values)
    if draft_sample is None:
        return "probabilistic" if can_sample else "greedy"
    if draft_sample not in DRAFT_SAMPLE_METHODS:
        choices = ", ".join(map(repr, DRAFT_SAMPLE_METHODS))
        raise ValueError(f"draft_sample_method must be one of {choices}, got {draft_sample!r}")
    if draft_sample == "probabilistic" and not can_sample:
        raise ValueError(
            f"draft_sample_method 'probabilistic' samples drafts from a draft distribution, which method "
            f"'{method}' does not have in this build (only {', '.join(DRAFT_SAMPLING_METHODS)}, and the children "
            f"of a branching speculative_token_tree of {', '.join(TREE_METHODS)} under rejection_sample_method "
            "'probabilistic'); allowed here: 'greedy'"
        )
    return draft_sample


def _check_rejection_sampling(values: dict[str, Any]) -> None:
    method, rate = values["rejection_sample_method"], values["synthetic_acceptance_rate"]
    if method not in REJECTION_SAMPLE_METHODS:
        choices = ", ".join(map(repr, REJECTION_SAMPLE_METHODS))
        aliases = ", ".join(f"{a!r} = {m!r}" for a, m in REJECTION_SAMPLE_ALIASES.items())
        raise ValueError(
            f"rejection_sample_method must be one of {choices}, got {method!r} "
            f"(vLLM's newer spellings are accepted too: {aliases}, the latter with Block Verify)"
        )
    values["draft_sample_method"] = _resolve_draft_sample_method(values)
    if method == "synthetic" and (rate is None or not 0.0 <= rate <= 1.0):
        raise ValueError(f"synthetic_acceptance_rate must be in [0, 1], but got {rate}")
    if method != "synthetic" and rate is not None:
        raise ValueError("synthetic_acceptance_rate is only valid with rejection_sample_method='synthetic'")
    for key in ("enable_block_verify", "enable_entropy_verify"):
        if values[key] and method != "probabilistic":
            raise ValueError(
                f"{key} changes the acceptance test of rejection_sample_method='probabilistic' (p/q), but "
                f"rejection_sample_method is {method!r}; set it to 'probabilistic' or remove {key}"
            )


def _check_bounds(values: dict[str, Any]) -> None:
    for key, (check, rule) in _BOUNDS.items():
        if not check(values[key]):
            raise ValueError(f"{key}={values[key]} {rule}")
