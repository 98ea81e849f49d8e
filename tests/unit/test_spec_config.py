"""SpeculativeConfig: vLLM's --speculative-config keys, defaults, rules and error messages."""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import warnings

import pytest

from verispec.spec_config import ALLOWED_KEYS, MTP_MODEL_TYPES, SpeculativeConfig

EAGLE = "yuhuili/EAGLE-LLaMA3.1-Instruct-8B"
LLAMA_DRAFT = {"model_type": "llama", "max_position_embeddings": 2048}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
EAGLE_CFG = {"method": "eagle", "model": EAGLE, "num_speculative_tokens": 3}
EAGLE_TREE = {**EAGLE_CFG, "num_speculative_tokens": 2, "speculative_token_tree": "[(0,), (1,), (0, 0)]"}
AUX_IDS = {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 18, 34]}}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_nextn_predict_layers": 1,
}


def make(config, **kwargs) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict(config, **kwargs)


# --- keys and defaults ---------------------------------------------------------------------------------


def test_every_reference_key_is_accepted():
    expected = {
        "method",
        "model",
        "num_speculative_tokens",
        "draft_tensor_parallel_size",
        "max_model_len",
        "quantization",
        "revision",
        "code_revision",
        "disable_by_batch_size",
        "disable_padded_drafter_batch",
        "disable_eagle_block_drop",
        "disable_logprobs",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "speculative_token_tree",
        "parallel_drafting",
        "rejection_sample_method",
        "synthetic_acceptance_rate",
        "draft_sample_method",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
        "enforce_eager",
        "enable_block_verify",
        "enable_entropy_verify",
        "posterior_threshold",
        "posterior_alpha",
        "draft_model_config",
        "num_speculative_tokens_per_batch_size",
        "enable_adaptive_verification",
        "use_heterogeneous_vocab",
        "eagle_topk",
        "num_draft_tokens",
        "dspark_confidence_threshold",
        "draft_vocab_size",
        "draft_vocab_file",
    }
    assert ALLOWED_KEYS == expected
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert fields == expected - {"draft_model_config"} | {"eagle_aux_hidden_state_layer_ids"}


def test_defaults():
    cfg = make({"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.method == "ngram" and cfg.model == "ngram"
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    assert cfg.disable_logprobs is True and cfg.disable_padded_drafter_batch is False
    assert cfg.disable_eagle_block_drop is False
    assert cfg.parallel_drafting is False and cfg.enforce_eager is None
    assert cfg.rejection_sample_method == "strict" and cfg.synthetic_acceptance_rate is None
    assert cfg.suffix_decoding_max_tree_depth == 24 and cfg.suffix_decoding_max_cached_requests == 10000
    assert cfg.suffix_decoding_max_spec_factor == 1.0 and cfg.suffix_decoding_min_token_prob == 0.1
    assert (cfg.enable_block_verify, cfg.enable_entropy_verify) == (False, False)
    assert (cfg.posterior_threshold, cfg.posterior_alpha) == (0.95, 0.4)
    assert cfg.disable_by_batch_size is None and cfg.quantization is None and cfg.revision is None
    assert cfg.draft_tensor_parallel_size is None and cfg.max_model_len is None
    assert cfg.num_lookahead_slots == 3


def test_config_is_frozen():
    cfg = make({"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_speculative_tokens = 4  # type: ignore[misc]


def test_numbers_given_as_int_become_floats():
    cfg = make(
        {"method": "suffix", "suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0}
    )
    assert (
        isinstance(cfg.suffix_decoding_max_spec_factor, float) and cfg.suffix_decoding_max_spec_factor == 2.0
    )
    assert isinstance(cfg.suffix_decoding_min_token_prob, float)


# --- ngram --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({}, (5, 5)),
        ({"prompt_lookup_min": 2}, (2, 2)),
        ({"prompt_lookup_max": 4}, (4, 4)),
        ({"prompt_lookup_min": 2, "prompt_lookup_max": 5}, (2, 5)),
        ({"prompt_lookup_min": None, "prompt_lookup_max": 3}, (3, 3)),
    ],
)
def test_ngram_lookup_bounds(extra, expected):
    cfg = make({"method": "ngram", "num_speculative_tokens": 4, **extra})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == expected


@pytest.mark.parametrize(
    "config, method, model",
    [
        ({"method": "[ngram]"}, "ngram", "ngram"),
        ({"model": "ngram"}, "ngram", "ngram"),
        ({"model": "[ngram]"}, "ngram", "ngram"),
        ({"method": "ngram_gpu"}, "ngram_gpu", "ngram_gpu"),
    ],
)
def test_ngram_aliases(config, method, model):
    cfg = make({**config, "num_speculative_tokens": 2})
    assert (cfg.method, cfg.model, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (method, model, 5, 5)


def test_non_ngram_methods_zero_the_lookup_bounds():
    cfg = make({"method": "eagle", "model": EAGLE, "num_speculative_tokens": 2, "prompt_lookup_min": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (0, 0)


# --- method normalisation and inference ---------------------------------------------------------------


@pytest.mark.parametrize("alias", MTP_MODEL_TYPES)
def test_deprecated_mtp_methods_warn_and_become_mtp(alias):
    with pytest.warns(FutureWarning, match=f"method `{alias}` is deprecated and replaced with mtp."):
        cfg = make({"method": alias, "num_speculative_tokens": 1})
    # None: the target checkpoint's own MTP layers
    assert cfg.method == "mtp" and cfg.model is None


def test_mtp_method_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make({"method": "mtp", "num_speculative_tokens": 1}).method == "mtp"


@pytest.mark.parametrize(
    "model, hf, method",
    [
        ("yuhuili/EAGLE-LLaMA3-Instruct-8B", None, "eagle"),
        ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", None, "eagle3"),
        ("AngelSlim/Qwen3-8B_eagle3", LLAMA_DRAFT, "eagle3"),
        ("z-lab/Qwen3-8B-DFlash-b16", None, "dflash"),
        ("FasterDecoding/medusa-vicuna-7b", {"model_type": "medusa"}, "medusa"),
        ("ibm/llama-accelerator", {"model_type": "mlp_speculator"}, "mlp_speculator"),
        ("deepseek-ai/DeepSeek-V3", DEEPSEEK_V3, "mtp"),
        ("some/ernie", {"model_type": "ernie4_5_moe", "num_nextn_predict_layers": 1}, "mtp"),
        ("some/qwen3-next", {"model_type": "qwen3_next"}, "mtp"),
        ("XiaomiMiMo/MiMo-7B-RL", {"model_type": "mimo", "architectures": ["MiMoForCausalLM"]}, "mtp"),
        ("some/glm", {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"]}, "mtp"),
        ("some/mtp-head", {"model_type": "deepseek_mtp"}, "mtp"),
        ("Qwen/Qwen3-0.6B", {"model_type": "qwen3"}, "draft_model"),
        ("Qwen/Qwen3-0.6B", None, "draft_model"),
    ],
)
def test_method_inferred_from_model(model, hf, method):
    cfg = make({"model": model, "num_speculative_tokens": 1}, draft_hf_config=hf)
    assert cfg.method == method and cfg.model == model


@pytest.mark.parametrize("model", ["my_team.drafters.Mine", "my_team.drafters:Mine"])
def test_custom_class_takes_an_import_path_as_model(model):
    """vLLM's custom_class: `model` is the proposer class's import path; without `method` such a path selects it.
    Like the model-free methods it has no n-gram bounds and no draft checkpoint limits."""
    for config in ({"model": model}, {"method": "custom_class", "model": model}):
        cfg = make({**config, "num_speculative_tokens": 3}, target_max_model_len=512)
        assert (cfg.method, cfg.model, cfg.max_model_len) == ("custom_class", model, 512)
        assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (0, 0)


def test_a_checkpoint_file_name_is_not_an_import_path():
    assert make({"model": "draft.gguf", "num_speculative_tokens": 3}).method == "draft_model"


@pytest.mark.parametrize("model", [None, "/some/folder", "no_dots", "my team.Drafter"])
def test_custom_class_without_an_import_path_is_refused(model):
    with pytest.raises(
        ValueError, match="method='custom_class' requires 'model' to contain the custom proposer"
    ):
        make({"method": "custom_class", "model": model, "num_speculative_tokens": 3})


def test_explicit_method_is_kept():
    cfg = make({"method": "draft_model", "model": EAGLE, "num_speculative_tokens": 2})
    assert cfg.method == "draft_model"


@pytest.mark.parametrize(
    "hf, given, expected",
    [
        ({"model_type": "mlp_speculator", "n_predict": 3}, None, 3),
        ({"model_type": "mlp_speculator", "n_predict": 3}, 2, 2),
        ({"model_type": "mlp_speculator", "n_predict": 3}, 6, 6),
        ({**DEEPSEEK_V3, "num_nextn_predict_layers": 2}, None, 2),
        # LongCat defaults to one MTP layer
        ({"model_type": "longcat_flash"}, None, 1),
    ],
)
def test_num_speculative_tokens_defaults_to_n_predict(hf, given, expected):
    config = {"model": "some/draft", "num_speculative_tokens": given}
    assert make(config, draft_hf_config=hf).num_speculative_tokens == expected


def test_mtp_without_model_reads_n_predict_from_the_target_config():
    cfg = make({"method": "mtp"}, draft_hf_config=DEEPSEEK_V3)
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("mtp", None, 1)


@pytest.mark.parametrize(
    "config, kind",
    [
        ({"method": "suffix"}, {"model": "suffix", "num_speculative_tokens": 24}),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 8}, {"num_speculative_tokens": 8}),
        ({"method": "suffix", "num_speculative_tokens": 5}, {"num_speculative_tokens": 5}),
        (
            {"method": "extract_hidden_states"},
            {"model": "extract_hidden_states", "num_speculative_tokens": 1},
        ),
    ],
)
def test_model_free_methods(config, kind):
    cfg = make(config)
    assert {key: getattr(cfg, key) for key in kind} == kind


def test_extract_hidden_states_layer_ids():
    cfg = make(
        {"method": "extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config": AUX_IDS}
    )
    assert cfg.eagle_aux_hidden_state_layer_ids == (2, 18, 34)
    assert cfg.to_dict()["draft_model_config"] == AUX_IDS


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model", "medusa", "mlp_speculator", "mtp"])
def test_supported_methods_accepts_listed_method(method):
    config = {"method": method, "model": "some/draft", "num_speculative_tokens": 1}
    assert make(config, supported_methods=[method]).method == method


# --- token tree ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tree, expected",
    [
        (None, "[(0,), (0, 0), (0, 0, 0)]"),
        ("[(0, 0), (1,), (0,), (0, 1), (1, 0)]", "[(0,), (1,), (0, 0), (0, 1), (1, 0)]"),
        ([(1,), (0,), (0, 0)], "[(0,), (1,), (0, 0)]"),
        ([[0], [0, 0], [2], [1]], "[(0,), (1,), (2,), (0, 0)]"),
        ("[[0], [0, 0]]", "[(0,), (0, 0)]"),
    ],
)
def test_token_tree_default_chain_and_breadth_first_sort(tree, expected):
    cfg = make({**EAGLE_CFG, "speculative_token_tree": tree})
    assert cfg.speculative_token_tree == expected
    assert str(cfg.token_tree) == expected


def test_dynamic_token_tree_defaults_and_lookahead():
    cfg = make({**EAGLE_CFG, "speculative_token_tree": "dynamic"})
    assert cfg.dynamic_tree and cfg.token_tree == []
    assert (cfg.eagle_topk, cfg.num_draft_tokens) == (4, 16)
    # every node of the tree is scored past the committed token
    assert cfg.num_lookahead_slots == 15
    sized = make({**EAGLE_CFG, "speculative_token_tree": "dynamic", "eagle_topk": 2, "num_draft_tokens": 3})
    assert (sized.eagle_topk, sized.num_draft_tokens, sized.num_lookahead_slots) == (2, 3, 3)
    assert make(sized.to_dict()) == sized


# --- parallelism and lengths --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, target_tp, expected",
    [
        ({"method": "eagle", "model": EAGLE}, 4, 4),
        ({"method": "eagle", "model": EAGLE, "draft_tensor_parallel_size": 1}, 4, 1),
        ({"method": "eagle", "model": EAGLE, "draft_tensor_parallel_size": 4}, 4, 4),
        ({"method": "mlp_speculator", "model": "ibm/acc"}, 4, 1),
        ({"method": "ngram"}, 4, None),
    ],
)
def test_draft_tensor_parallel_size(config, target_tp, expected):
    cfg = make({**config, "num_speculative_tokens": 2}, target_tensor_parallel_size=target_tp)
    assert cfg.draft_tensor_parallel_size == expected


@pytest.mark.parametrize(
    "user, hf, target, expected",
    [
        (None, LLAMA_DRAFT, 4096, 2048),
        (None, LLAMA_DRAFT, 1024, 1024),
        (512, LLAMA_DRAFT, 1024, 512),
        (None, {"max_position_embeddings": 4096, "seq_length": 3000}, None, 3000),
        (None, None, 4096, 4096),
        (None, None, None, None),
    ],
)
def test_draft_max_model_len(user, hf, target, expected):
    config = {"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 2, "max_model_len": user}
    assert make(config, draft_hf_config=hf, target_max_model_len=target).max_model_len == expected


def test_ngram_max_model_len_follows_target():
    cfg = make(NGRAM, draft_hf_config=LLAMA_DRAFT, target_max_model_len=8192)
    assert cfg.max_model_len == 8192


# --- sampling keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"rejection_sample_method": "strict"},
        {"rejection_sample_method": "probabilistic"},
        {"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0},
        {"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 1.0},
        {
            "rejection_sample_method": "probabilistic",
            "enable_block_verify": True,
            "enable_entropy_verify": True,
        },
        {"posterior_threshold": 1, "posterior_alpha": 0},
        {"parallel_drafting": True},
    ],
)
def test_valid_sampling_keys(extra):
    cfg = make({"method": "eagle3", "model": "some/eagle3", "num_speculative_tokens": 3, **extra})
    assert all(getattr(cfg, key) == value for key, value in extra.items())


@pytest.mark.parametrize("given", [{}, {"parallel_drafting": False}])
def test_dflash_always_drafts_in_parallel(given):
    """As in vLLM: method 'dflash' sets parallel_drafting (its draft fills a block of mask tokens in one forward)."""
    cfg = make(
        {"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 3, **given}
    )
    assert cfg.parallel_drafting is True


@pytest.mark.parametrize(
    "extra, method, block",
    [
        ({"rejection_sample_method": "standard"}, "probabilistic", False),
        ({"rejection_sample_method": "block"}, "probabilistic", True),
        ({"rejection_sample_method": "block", "enable_block_verify": True}, "probabilistic", True),
        ({"rejection_sample_method": "block", "enable_entropy_verify": True}, "probabilistic", True),
    ],
)
def test_vllm_rejection_sample_spellings(extra, method, block):
    cfg = make({**EAGLE_CFG, **extra})
    assert (cfg.rejection_sample_method, cfg.enable_block_verify) == (method, block)
    assert make(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "config, expected",
    [
        (NGRAM, "greedy"),
        ({"method": "suffix"}, "greedy"),
        (EAGLE_CFG, "greedy"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3}, "probabilistic"),
        (
            {
                "method": "draft_model",
                "model": "d",
                "num_speculative_tokens": 3,
                "draft_sample_method": "greedy",
            },
            "greedy",
        ),
        ({**NGRAM, "draft_sample_method": "greedy"}, "greedy"),
        ({**EAGLE_CFG, "draft_sample_method": None}, "greedy"),
        # a branching tree under probabilistic samples its children by default; greedy keeps the top-ranked ones
        ({**EAGLE_TREE, "rejection_sample_method": "probabilistic"}, "probabilistic"),
        (
            {**EAGLE_TREE, "rejection_sample_method": "probabilistic", "draft_sample_method": "greedy"},
            "greedy",
        ),
        ({**EAGLE_TREE, "rejection_sample_method": "strict"}, "greedy"),
        ({**EAGLE_CFG, "rejection_sample_method": "probabilistic"}, "greedy"),
        (
            {**EAGLE_CFG, "speculative_token_tree": "dynamic", "rejection_sample_method": "probabilistic"},
            "greedy",
        ),
    ],
)
def test_draft_sample_method(config, expected):
    cfg = make(config)
    assert cfg.draft_sample_method == expected
    assert make(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "config",
    [
        {**EAGLE_CFG, "rejection_sample_method": "probabilistic"},
        {**EAGLE_TREE, "rejection_sample_method": "strict"},
        {**EAGLE_CFG, "speculative_token_tree": "dynamic", "rejection_sample_method": "probabilistic"},
    ],
)
def test_sampled_drafts_of_a_head_need_a_branching_tree_under_probabilistic(config):
    with pytest.raises(ValueError, match="children of a branching speculative_token_tree"):
        make({**config, "draft_sample_method": "probabilistic"})


def test_tree_children_follow_draft_sample_method():
    from verispec.proposers.factory import _samples_trees

    tree = {**EAGLE_TREE, "rejection_sample_method": "probabilistic"}
    assert _samples_trees(make(tree))
    assert not _samples_trees(make({**tree, "draft_sample_method": "greedy"}))


# --- errors -------------------------------------------------------------------------------------------

ERRORS = [
    # keys and types
    ({"tensor_parallel_size": 2, **NGRAM}, {}, "Please pass 'draft_tensor_parallel_size' instead."),
    ({"target_model_config": {}, **NGRAM}, {}, "'target_model_config' is populated internally"),
    ({"num_spec_tokens": 3, "method": "ngram"}, {}, "Unknown key(s) 'num_spec_tokens'"),
    ({"num_spec_tokens": 3, "method": "ngram"}, {}, "did you mean 'num_speculative_tokens'?"),
    ({"foo": 1, **NGRAM}, {}, "Allowed keys: code_revision, disable_by_batch_size"),
    (
        {**NGRAM, "num_speculative_tokens": "3"},
        {},
        "'num_speculative_tokens' must be an int or null, got '3'",
    ),
    ({**NGRAM, "num_speculative_tokens": True}, {}, "'num_speculative_tokens' must be an int or null"),
    ({**NGRAM, "num_speculative_tokens": 3.0}, {}, "'num_speculative_tokens' must be an int or null"),
    ({**NGRAM, "disable_logprobs": "yes"}, {}, "'disable_logprobs' must be a bool, got 'yes'"),
    ({**NGRAM, "disable_logprobs": None}, {}, "'disable_logprobs' must be a bool, got None"),
    (
        {**NGRAM, "suffix_decoding_min_token_prob": "0.1"},
        {},
        "'suffix_decoding_min_token_prob' must be a finite float",
    ),
    ({**NGRAM, "suffix_decoding_max_spec_factor": float("nan")}, {}, "must be a finite float"),
    ({**NGRAM, "suffix_decoding_max_spec_factor": float("inf")}, {}, "must be a finite float"),
    (
        {**NGRAM, "num_speculative_tokens": 10**6},
        {},
        "num_speculative_tokens=1000000 is more than this build verifies per step (1..1024)",
    ),
    ({**NGRAM, "method": 5}, {}, "'method' must be a str or null"),
    ({**NGRAM, "speculative_token_tree": 5}, {}, "must be a str or a list of tuples of ints"),
    ({**NGRAM, "rejection_sample_method": None}, {}, "'rejection_sample_method' must be a str, got None"),
    # method / model
    ({"num_speculative_tokens": 3}, {}, "must set `method` or `model` (num_speculative_tokens was provided"),
    ({}, {}, "speculative_config must set `method` or `model`"),
    ({**NGRAM, "method": "lookahead"}, {}, "Unknown speculative method 'lookahead'"),
    (
        {"method": "eagle", "num_speculative_tokens": 3},
        {},
        "num_speculative_tokens was provided but without speculative model",
    ),
    ({"method": "eagle3"}, {}, "Speculative method 'eagle3' requires `model`"),
    ({"method": "draft_model"}, {}, "Speculative method 'draft_model' requires `model`"),
    ({"method": "medusa"}, {}, "Speculative method 'medusa' requires `model`"),
    ({"method": "mlp_speculator"}, {}, "Speculative method 'mlp_speculator' requires `model`"),
    ({"method": "dflash"}, {}, "Speculative method 'dflash' requires `model`"),
    (
        EAGLE_CFG,
        {"supported_methods": ["ngram", "draft_model"]},
        "speculative method 'eagle' is not supported by this build yet; supported methods: draft_model, ngram",
    ),
    (
        {"method": "mtp", "num_speculative_tokens": 1},
        {"draft_hf_config": LLAMA_DRAFT},
        "method 'mtp' needs a checkpoint with MTP layers",
    ),
    (
        {**EAGLE_CFG, "draft_model_config": {"hf_config": {}}},
        {},
        "'draft_model_config' is populated internally",
    ),
    (
        {"method": "extract_hidden_states", "draft_model_config": {"hf_config": {"x": 1}}},
        {},
        "accepts it only for method",
    ),
    (
        {
            "method": "extract_hidden_states",
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": "2"}},
        },
        {},
        "must be a list of layer indices",
    ),
    # ngram
    ({**NGRAM, "prompt_lookup_min": 0}, {}, "prompt_lookup_min=0 must be > 0"),
    ({**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 0}, {}, "prompt_lookup_max=0 must be > 0"),
    (
        {**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        {},
        "prompt_lookup_min=4 must be <= prompt_lookup_max=2",
    ),
    # num_speculative_tokens
    (
        {**NGRAM, "num_speculative_tokens": 0},
        {},
        "Expected num_speculative_tokens to be greater than zero (0).",
    ),
    (
        {**EAGLE_CFG, "num_speculative_tokens": -1},
        {},
        "Expected num_speculative_tokens to be greater than zero (-1).",
    ),
    (
        {"method": "ngram"},
        {},
        "num_speculative_tokens must be provided with speculative model unless the draft model config contains an n_predict parameter.",
    ),
    (
        {"method": "eagle", "model": EAGLE},
        {"draft_hf_config": LLAMA_DRAFT},
        "unless the draft model config contains an n_predict",
    ),
    (
        {"method": "mtp", "num_speculative_tokens": 3},
        {"draft_hf_config": {**DEEPSEEK_V3, "num_nextn_predict_layers": 2}},
        "num_speculative_tokens:3 must be divisible by n_predict=2",
    ),
    (
        {"model": "x", "num_speculative_tokens": 4},
        {"draft_hf_config": {"n_predict": 3}},
        "num_speculative_tokens:4 must be divisible by n_predict=3",
    ),
    (
        {"method": "extract_hidden_states", "num_speculative_tokens": 2},
        {},
        "extract_hidden_states requires num_speculative_tokens=1, got 2",
    ),
    (
        {"model": "x", "num_speculative_tokens": 1},
        {"draft_hf_config": {"n_predict": "3"}},
        "draft_hf_config n_predict='3' must be a positive int",
    ),
    # sizes
    (
        {**NGRAM, "disable_by_batch_size": 1},
        {},
        "Expect the batch size threshold of disabling speculative decoding is > 1, but got disable_by_batch_size=1",
    ),
    (
        {**EAGLE_CFG, "draft_tensor_parallel_size": 3},
        {"target_tensor_parallel_size": 2},
        "speculative_draft_tensor_parallel_size=3 cannot be other value than 1 or target model tensor_parallel_size",
    ),
    (
        {**NGRAM, "draft_tensor_parallel_size": 0},
        {},
        "cannot be other value than 1 or target model tensor_parallel_size",
    ),
    (
        {**EAGLE_CFG, "max_model_len": 4096},
        {"draft_hf_config": LLAMA_DRAFT},
        "speculative_max_model_len=4096 cannot be larger than draft_max_model_len=2048",
    ),
    (
        {**EAGLE_CFG, "max_model_len": 2048},
        {"target_max_model_len": 1024},
        "speculative_max_model_len=2048 cannot be larger than target_max_model_len=1024",
    ),
    ({**NGRAM, "max_model_len": 0}, {}, "max_model_len=0 must be >= 1"),
    (NGRAM, {"target_tensor_parallel_size": 0}, "target_tensor_parallel_size=0 must be an int >= 1"),
    (NGRAM, {"target_max_model_len": 0}, "target_max_model_len=0 must be an int >= 1"),
    # rejection sampling, suffix decoding, block / entropy verify
    (
        {**NGRAM, "rejection_sample_method": "lenient"},
        {},
        "rejection_sample_method must be one of 'strict', 'probabilistic', 'synthetic', got 'lenient'",
    ),
    (
        {**NGRAM, "rejection_sample_method": "synthetic"},
        {},
        "synthetic_acceptance_rate must be in [0, 1], but got None",
    ),
    (
        {**NGRAM, "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 1.5},
        {},
        "synthetic_acceptance_rate must be in [0, 1], but got 1.5",
    ),
    (
        {**NGRAM, "synthetic_acceptance_rate": 0.5},
        {},
        "synthetic_acceptance_rate is only valid with rejection_sample_method='synthetic'",
    ),
    (
        {"method": "suffix", "suffix_decoding_max_tree_depth": 0},
        {},
        "suffix_decoding_max_tree_depth=0 must be >= 1",
    ),
    (
        {"method": "suffix", "suffix_decoding_max_cached_requests": -1},
        {},
        "suffix_decoding_max_cached_requests=-1 must be >= 0",
    ),
    (
        {"method": "suffix", "suffix_decoding_max_spec_factor": -0.5},
        {},
        "suffix_decoding_max_spec_factor=-0.5 must be >= 0",
    ),
    (
        {"method": "suffix", "suffix_decoding_min_token_prob": 1.5},
        {},
        "suffix_decoding_min_token_prob=1.5 must be in [0, 1]",
    ),
    ({**NGRAM, "posterior_threshold": 0}, {}, "posterior_threshold=0.0 must be in (0, 1]"),
    ({**NGRAM, "posterior_alpha": -1}, {}, "posterior_alpha=-1.0 must be >= 0"),
    (
        {**NGRAM, "enable_block_verify": True},
        {},
        "enable_block_verify changes the acceptance test of rejection_sample_method='probabilistic' (p/q), but rejection_sample_method is 'strict'",
    ),
    (
        {
            **NGRAM,
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rate": 0.5,
            "enable_entropy_verify": True,
        },
        {},
        "set it to 'probabilistic' or remove enable_entropy_verify",
    ),
    (
        {**NGRAM, "parallel_drafting": True},
        {},
        "parallel_drafting is only compatible with EAGLE and draft-model methods",
    ),
    (
        {**NGRAM, "rejection_sample_method": "typical"},
        {},
        "vLLM's newer spellings are accepted too: 'standard' = 'probabilistic', 'block' = 'probabilistic'",
    ),
    (
        {**NGRAM, "rejection_sample_method": "block", "enable_block_verify": False},
        {},
        "rejection_sample_method 'block' is Block Verification, but enable_block_verify is false",
    ),
    (
        {**NGRAM, "rejection_sample_method": "block", "synthetic_acceptance_rate": 0.5},
        {},
        "synthetic_acceptance_rate is only valid with rejection_sample_method='synthetic'",
    ),
    (
        {**NGRAM, "draft_sample_method": "random"},
        {},
        "draft_sample_method must be one of 'greedy', 'probabilistic', got 'random'",
    ),
    (
        {**NGRAM, "draft_sample_method": 1},
        {},
        "speculative_config key 'draft_sample_method' must be a str or null, got 1",
    ),
    (
        {**NGRAM, "draft_sample_method": "probabilistic"},
        {},
        "draft_sample_method 'probabilistic' samples drafts from a draft distribution, which method 'ngram' does not have in this build (only draft_model, and the children of a branching speculative_token_tree",
    ),
    ({"method": "suffix", "draft_sample_method": "probabilistic"}, {}, "which method 'suffix' does not have"),
    ({**EAGLE_CFG, "draft_sample_method": "probabilistic"}, {}, "which method 'eagle' does not have"),
    (
        {**NGRAM, "draft_sampling_method": "greedy"},
        {},
        "Unknown key(s) 'draft_sampling_method' in speculative_config (did you mean 'draft_sample_method'?)",
    ),
    # token tree
    (
        {**EAGLE_CFG, "speculative_token_tree": "[(0,), (0, 1"},
        {},
        "speculative_token_tree could not be parsed",
    ),
    (
        {**EAGLE_CFG, "speculative_token_tree": "[]"},
        {},
        "speculative_token_tree must be a non-empty list of tuples",
    ),
    (
        {**EAGLE_CFG, "speculative_token_tree": "'abc'"},
        {},
        "speculative_token_tree must be a non-empty list of tuples",
    ),
    (
        {**EAGLE_CFG, "speculative_token_tree": "[(0,), (-1,)]"},
        {},
        "node (-1,) must be a non-empty tuple of ints >= 0",
    ),
    (
        {**EAGLE_CFG, "speculative_token_tree": [(0,), ()]},
        {},
        "node () must be a non-empty tuple of ints >= 0",
    ),
    (
        {**EAGLE_CFG, "speculative_token_tree": "[(0,), (0,)]"},
        {},
        "speculative_token_tree has duplicate nodes",
    ),
    ({**EAGLE_CFG, "speculative_token_tree": "[(0,), (1, 0)]"}, {}, "node (1, 0) has no parent (1,)"),
    ({**EAGLE_CFG, "speculative_token_tree": "dynamo"}, {}, "(0, 0)]' or 'dynamic'"),
    ({**EAGLE_CFG, "num_draft_tokens": 8}, {}, "num_draft_tokens sizes dynamic trees: it needs"),
    ({**EAGLE_CFG, "speculative_token_tree": "dynamic", "eagle_topk": 0}, {}, "eagle_topk=0 must be >= 1"),
    # input shape
    ([("method", "ngram")], {}, "speculative_config must be a mapping (JSON object), got list"),
    (NGRAM, {"draft_hf_config": ["llama"]}, "draft_hf_config must be a mapping"),
]


@pytest.mark.parametrize("config, kwargs, message", ERRORS)
def test_errors(config, kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        make(config, **kwargs)
    assert message in str(excinfo.value)


# --- input handling -----------------------------------------------------------------------------------


def test_user_dict_is_not_mutated():
    config = {
        "method": "extract_hidden_states",
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}},
        "suffix_decoding_max_spec_factor": 2,
    }
    ngram = {"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    eagle = {**EAGLE_CFG, "speculative_token_tree": [[1], [0], [0, 0]], "draft_tensor_parallel_size": None}
    for cfg in (config, ngram, eagle):
        before = copy.deepcopy(cfg)
        make(cfg, draft_hf_config=LLAMA_DRAFT, target_max_model_len=1024)
        assert cfg == before


def test_read_only_mapping_input():
    cfg = make(types.MappingProxyType({"method": "ngram", "num_speculative_tokens": 2}))
    assert cfg.method == "ngram"


def test_from_json_matches_from_dict():
    text = '{"method": "eagle", "model": "%s", "num_speculative_tokens": 2, "speculative_token_tree": [[0], [1]]}'
    kwargs = {"target_max_model_len": 4096, "target_tensor_parallel_size": 2, "draft_hf_config": LLAMA_DRAFT}
    from_json = SpeculativeConfig.from_json(text % EAGLE, **kwargs)
    assert from_json == make(json.loads(text % EAGLE), **kwargs)
    assert from_json.speculative_token_tree == "[(0,), (1,)]" and from_json.max_model_len == 2048


@pytest.mark.parametrize(
    "text, message",
    [
        ("{method: ngram}", "speculative_config is not valid JSON"),
        ("[1, 2]", "speculative_config must be a mapping (JSON object), got list"),
        ('{"method": "ngram", "num_speculative_tokens": 3.5}', "'num_speculative_tokens' must be an int"),
    ],
)
def test_from_json_errors(text, message):
    with pytest.raises(ValueError) as excinfo:
        SpeculativeConfig.from_json(text)
    assert message in str(excinfo.value)


def test_from_json_supported_methods():
    with pytest.raises(ValueError, match="speculative method 'suffix' is not supported by this build yet"):
        SpeculativeConfig.from_json('{"method": "suffix"}', supported_methods=("ngram",))


# --- to_dict ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, kwargs",
    [
        (NGRAM, {}),
        ({"method": "suffix"}, {}),
        ({"method": "deepseek_mtp"}, {"draft_hf_config": DEEPSEEK_V3}),
        ({**EAGLE_CFG, "speculative_token_tree": "[(1,), (0,)]"}, {"draft_hf_config": LLAMA_DRAFT}),
        ({"model": "ibm/acc"}, {"draft_hf_config": {"model_type": "mlp_speculator", "n_predict": 3}}),
        ({"method": "extract_hidden_states", "draft_model_config": AUX_IDS}, {}),
    ],
)
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_to_dict_round_trips(config, kwargs):
    kwargs = {"target_max_model_len": 4096, "target_tensor_parallel_size": 2, **kwargs}
    cfg = make(config, **kwargs)
    out = cfg.to_dict()
    assert json.loads(json.dumps(out)) == out
    assert make(out, **kwargs) == cfg
    assert out["method"] == cfg.method and out["num_speculative_tokens"] == cfg.num_speculative_tokens


def test_adaptive_verification_defaults_on_and_takes_a_bool():
    assert make({"method": "ngram", "num_speculative_tokens": 3}).enable_adaptive_verification is True
    cfg = make({"method": "ngram", "num_speculative_tokens": 3, "enable_adaptive_verification": False})
    assert cfg.enable_adaptive_verification is False
    with pytest.raises(ValueError, match="'enable_adaptive_verification' must be a bool"):
        make({"method": "ngram", "num_speculative_tokens": 3, "enable_adaptive_verification": "yes"})


@pytest.mark.parametrize(
    "schedule, message",
    [
        ([], "num_speculative_tokens_per_batch_size must not be empty"),
        ([[3, 2, 1]], "Batch-size range start must be <= end"),
        ([[0, 2, 1]], r"Batch-size range \(0, 2\) must be positive"),
        ([[1, 4, 2], [4, 8, 1]], "Batch-size ranges must be non-overlapping and sorted"),
        ([[2, 8, 2]], "The first batch-size range must start at 1"),
        ([[1, 4, -1]], "K values must be >= 0"),
        ([[1, 4]], r"entry must be a 3-item sequence \(range_start, range_end, num_speculative_tokens\)"),
        ([[1, 4, 2.0]], "3-item sequence"),
        ("1-4:2", "must be a list of"),
    ],
)
def test_per_batch_size_schedule_is_validated_with_vllms_messages(schedule, message):
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": schedule}
    with pytest.raises(ValueError, match=message):
        make(cfg)


def test_per_batch_size_schedule_k_above_the_cap_is_kept_for_clamping():
    """vLLM clamps a range's K to num_speculative_tokens where it applies the schedule; it does not refuse it.
    Ranges given out of order are stored sorted."""
    schedule = [[5, 8, 2], [1, 4, 9]]
    cfg = make(
        {"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": schedule}
    )
    assert cfg.num_speculative_tokens_per_batch_size == ((1, 4, 9), (5, 8, 2))


def test_per_batch_size_schedule_round_trips():
    schedule = [[1, 4, 4], [5, 64, 1], [65, 1024, 0]]
    cfg = make(
        {"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": schedule}
    )
    assert cfg.num_speculative_tokens_per_batch_size == ((1, 4, 4), (5, 64, 1), (65, 1024, 0))
    again = make(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


def test_heterogeneous_vocab_defaults_off_takes_a_bool_and_needs_draft_model():
    draft = {"method": "draft_model", "model": "/d", "num_speculative_tokens": 3}
    assert make(draft).use_heterogeneous_vocab is False
    cfg = make({**draft, "use_heterogeneous_vocab": True, "draft_sample_method": "probabilistic"})
    assert cfg.use_heterogeneous_vocab is True and cfg.draft_sample_method == "probabilistic"
    assert make(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="'use_heterogeneous_vocab' must be a bool"):
        make({**draft, "use_heterogeneous_vocab": "true"})
    for other in (NGRAM, EAGLE_CFG, {"method": "suffix"}):
        with pytest.raises(ValueError, match="use_heterogeneous_vocab only works with method='draft_model'"):
            make({**other, "use_heterogeneous_vocab": True})
    # false is accepted with any method
    assert make({**NGRAM, "use_heterogeneous_vocab": False}).use_heterogeneous_vocab is False


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"draft_vocab_size": 0}, "draft_vocab_size must be a positive int"),
        (
            {"draft_vocab_size": 64, "draft_vocab_file": "v.bin"},
            "set one of draft_vocab_size and draft_vocab_file",
        ),
        ({"draft_vocab_size": "64"}, "speculative_config key 'draft_vocab_size' must be an int or null"),
    ],
)
def test_draft_vocab_keys_are_checked(extra, match):
    with pytest.raises(ValueError, match=match):
        make({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, **extra})
    assert (
        make(
            {"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "draft_vocab_size": 64}
        ).draft_vocab_size
        == 64
    )


def test_draft_vocab_keys_belong_to_draft_model():
    with pytest.raises(
        ValueError, match="draft_vocab_file trims a draft model's LM head and only works with"
    ):
        make({"method": "ngram", "num_speculative_tokens": 3, "draft_vocab_file": "v.bin"})
