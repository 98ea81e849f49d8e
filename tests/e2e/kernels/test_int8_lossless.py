"""activation_dtype="int8": speculation still changes nothing (greedy equality for every speculative method against
plain decoding in int8 mode), on a tiny GGUF target whose weights stay quantized (Q4_1 layers, Q8_0 head). Drafts on
quantized blocks take int8 activations under a float32 target too: the same equality holds there."""

from __future__ import annotations

import pytest
import torch

from tests import helpers
from verispec import LLM, SamplingParams
from verispec.kernels.build import int8_isa
from verispec.kernels.qweight import GROUP, QK, float_layout

pytestmark = pytest.mark.skipif(int8_isa() is None, reason="no int8 kernel (no kernel library) here")

BATCHES = (1, 4)
SP = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """activation_dtype -> batch size -> plain decoding's greedy tokens."""
    out = {}
    # float32 activations: the layout this CPU's kernels chose (q4t / q8t on an AMX build)
    for dtype, want in (("int8", {"q4v", "q8v"}), ("float32", {float_layout("q4"), float_layout("q8")})):
        llm = LLM(tiny_gguf, device="cpu", max_model_len=256, max_num_seqs=4, activation_dtype=dtype)
        fmts = {m.qweight.fmt for m in llm.ckpt.model.modules() if getattr(m, "qweight", None) is not None}
        assert fmts == want, fmts
        assert llm.ckpt.model.fused is not None
        out[dtype] = {
            b: [o.outputs[0].token_ids for o in llm.generate(helpers.prompts(b, b), SP, use_tqdm=False)]
            for b in BATCHES
        }
    return out


def _configs(
    tiny_gguf, tiny_draft, tiny_medusa, tiny_mlp_speculator, tiny_eagle, tiny_eagle3, tiny_dflash
) -> dict:
    return {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
        "suffix": {"method": "suffix", "num_speculative_tokens": 3},
        "draft_model": {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3},
        "draft_model_self": {"method": "draft_model", "model": tiny_gguf, "num_speculative_tokens": 3},
        "medusa": {"method": "medusa", "model": tiny_medusa, "num_speculative_tokens": 3},
        "mlp_speculator": {
            "method": "mlp_speculator",
            "model": tiny_mlp_speculator,
            "num_speculative_tokens": 3,
        },
        "eagle": {"method": "eagle", "model": tiny_eagle, "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": tiny_eagle3, "num_speculative_tokens": 3},
        "dflash": {"method": "dflash", "model": tiny_dflash, "num_speculative_tokens": 3},
    }


@pytest.mark.parametrize("activation_dtype", ["int8", "float32"])
@pytest.mark.parametrize(
    "method",
    [
        "ngram",
        "suffix",
        "draft_model",
        "draft_model_self",
        "medusa",
        "mlp_speculator",
        "eagle",
        "eagle3",
        "dflash",
    ],
)
def test_int8_greedy_equality(
    tiny_gguf,
    tiny_draft,
    tiny_medusa,
    tiny_mlp_speculator,
    tiny_eagle,
    tiny_eagle3,
    tiny_dflash,
    reference,
    method,
    activation_dtype,
):
    drafts = (tiny_draft, tiny_medusa, tiny_mlp_speculator, tiny_eagle, tiny_eagle3, tiny_dflash)
    cfg = _configs(tiny_gguf, *drafts)[method]
    llm = LLM(
        tiny_gguf,
        device="cpu",
        max_model_len=256,
        max_num_seqs=4,
        activation_dtype=activation_dtype,
        speculative_config=cfg,
    )
    for b in BATCHES:
        outs = llm.generate(helpers.prompts(b, b), SP, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference[activation_dtype][b], f"{method} batch={b}"
    spec = llm.engine.counters.spec
    assert spec.num_draft_tokens > 0
    if method == "draft_model_self" and activation_dtype == "int8":
        # the target drafting for itself in its own numerics: its draft and verify steps round alike, always right
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    # a draft with a forward of its own (a model, or heads) on quantized weights takes int8 activations, also under
    # a float32 target (drafts only propose)
    prop = llm.engine.proposer
    draft = prop.runner.model if hasattr(prop, "runner") else getattr(prop, "heads", None)
    if draft is not None:
        fmts = {m.qweight.fmt for m in draft.modules() if getattr(m, "qweight", None) is not None}
        assert fmts and fmts <= {"q4v", "q8v", "q6v"}, f"{method}: {fmts}"
        if method.startswith("draft_model"):
            # a draft model (float safetensors or GGUF) runs its layers fused on those blocks, as the target does
            assert draft.fused is not None, method
        # a float layer is left only where Q8_0 blocks cannot hold its shape (32-column blocks, 16-row groups)
        left = [m for m in draft.modules() if type(m) is torch.nn.Linear]
        assert all(m.in_features % QK or m.out_features % GROUP for m in left), method


def test_int8_modules_equal_fused_layers(tiny_gguf, reference, monkeypatch):
    """The PyTorch module path (VERISPEC_FUSED_LAYERS=0) calls the same int8 kernels: the same tokens."""
    monkeypatch.setenv("VERISPEC_FUSED_LAYERS", "0")
    llm = LLM(tiny_gguf, device="cpu", max_model_len=256, max_num_seqs=4, activation_dtype="int8")
    assert llm.ckpt.model.fused is None
    for b in BATCHES:
        outs = llm.generate(helpers.prompts(b, b), SP, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference["int8"][b]


def test_int8_errors(tiny_llama, tiny_gguf, monkeypatch):
    with pytest.raises(ValueError, match=r"activation_dtype='bfloat16'.*float32, int8"):
        LLM(tiny_gguf, device="cpu", activation_dtype="bfloat16")
    # an HF float32 checkpoint keeps no quantized weight
    with pytest.raises(ValueError, match="kept quantized"):
        LLM(tiny_llama, device="cpu", activation_dtype="int8")
    with pytest.raises(ValueError, match="kept quantized"):
        LLM(tiny_gguf, device="cpu", activation_dtype="int8", keep_quantized=False)
    # no int8 kernel (no kernel library)
    monkeypatch.setattr("verispec.kernels.build.int8_isa", lambda lib=None: None)
    with pytest.raises(ValueError, match="needs the native kernels"):
        LLM(tiny_gguf, device="cpu", activation_dtype="int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_int8_on_cuda_is_an_error(tiny_gguf):
    with pytest.raises(ValueError, match="CPU only.*device='cpu'"):
        LLM(tiny_gguf, device="cuda", activation_dtype="int8")


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_cli_rejects_an_unknown_activation_dtype(command, capsys):
    from verispec.cli import build_parser

    argv = [command, "--activation-dtype", "int4"] + (["-p", "hi"] if command == "generate" else [])
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert "float32" in capsys.readouterr().err


def test_serve_config_file_takes_activation_dtype(tmp_path):
    from verispec.server.cli import load_config_file

    path = tmp_path / "c.yaml"
    path.write_text("activation-dtype: int8\n")
    assert load_config_file(str(path)) == {"activation_dtype": "int8"}
    path.write_text("activation_dtype: 8\n")
    with pytest.raises(ValueError, match="activation_dtype must be a string"):
        load_config_file(str(path))


@pytest.fixture(scope="module")
def tiny_q6_k_gguf(tmp_path_factory) -> str:
    """A tiny llama whose rows are whole Q6_K super-blocks (hidden 256, intermediate 512): every projection and the
    LM head in Q6_K (llama.cpp's Q4_K_M and Q6_K files hold such tensors)."""
    from tests.tiny_models import write_tiny_checkpoint, write_tiny_gguf

    root = tmp_path_factory.mktemp("q6k")
    hf = write_tiny_checkpoint(
        root / "hf", "llama", seed=7, num_layers=2, hidden_size=256, intermediate_size=512
    )
    return str(write_tiny_gguf(hf, root / "tiny-q6k.gguf", layer_type="Q6_K", head_type="Q6_K"))


@pytest.mark.parametrize(("activation_dtype", "fmt"), [("float32", "q6"), ("int8", "q6kv")])
def test_q6_k_target(tiny_q6_k_gguf, activation_dtype, fmt, monkeypatch):
    """Q6_K weights stay quantized in both activation dtypes and run fused; speculation (ngram, the model drafting
    for itself) and the module path give the plain fused tokens."""
    kw = dict(max_model_len=256, max_num_seqs=4, activation_dtype=activation_dtype)
    llm = LLM(tiny_q6_k_gguf, device="cpu", **kw)
    fmts = {m.qweight.fmt for m in llm.ckpt.model.modules() if getattr(m, "qweight", None) is not None}
    assert fmts == {fmt}
    assert llm.ckpt.model.fused is not None
    prompts = helpers.prompts(4, 11)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, SP, use_tqdm=False)]
    for cfg in (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "draft_model", "model": tiny_q6_k_gguf, "num_speculative_tokens": 3},
    ):
        spec = LLM(tiny_q6_k_gguf, device="cpu", speculative_config=cfg, **kw)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, SP, use_tqdm=False)] == ref, cfg[
            "method"
        ]
        assert spec.engine.counters.spec.num_accepted_tokens > 0
    monkeypatch.setenv("VERISPEC_FUSED_LAYERS", "0")
    modules = LLM(tiny_q6_k_gguf, device="cpu", **kw)
    assert modules.ckpt.model.fused is None
    assert [o.outputs[0].token_ids for o in modules.generate(prompts, SP, use_tqdm=False)] == ref


@pytest.fixture(scope="module")
def tiny_q4_k_m_gguf(tmp_path_factory) -> str:
    """A tiny llama in a Q4_K_M file's mix (hidden 256): Q4_K projections, the v projection in Q5_0 (as the 0.5B's
    q, k, o and MLP are), the LM head in Q6_K."""
    from tests.tiny_models import write_tiny_checkpoint, write_tiny_gguf

    root = tmp_path_factory.mktemp("q4km")
    hf = write_tiny_checkpoint(
        root / "hf", "llama", seed=11, num_layers=2, hidden_size=256, intermediate_size=512
    )
    return str(
        write_tiny_gguf(hf, root / "tiny-q4km.gguf", layer_type="Q4_K", head_type="Q6_K", v_type="Q5_0")
    )


def test_compact_layouts_change_no_token(tiny_q4_k_m_gguf, monkeypatch):
    """int8 activations on a Q4_K_M-style file run q4kv / q5v / q6kv (fused) and give the wide layouts' tokens,
    plain and speculative."""
    from verispec.kernels import qweight

    kw = dict(max_model_len=256, max_num_seqs=4, activation_dtype="int8")
    prompts = helpers.prompts(4, 5)

    def run(llm_kw: dict, want: set[str] | None = None) -> list[list[int]]:
        llm = LLM(tiny_q4_k_m_gguf, device="cpu", **kw, **llm_kw)
        if want is not None:
            layers = [m for m in llm.ckpt.model.modules() if getattr(m, "quantized", False)]
            fmts = {q.fmt for m in layers for q in (m.qparts or [m.qweight])}
            assert fmts == want
            assert llm.ckpt.model.fused is not None
        return [o.outputs[0].token_ids for o in llm.generate(prompts, SP, use_tqdm=False)]

    ref = run({}, {"q4kv", "q5v", "q6kv"})
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert run({"speculative_config": ngram}) == ref
    draft = {"method": "draft_model", "model": tiny_q4_k_m_gguf, "num_speculative_tokens": 3}
    assert run({"speculative_config": draft}) == ref
    # the wide layouts (read from the GGUF, not the layout cache)
    monkeypatch.setattr(qweight, "COMPACT", {})
    monkeypatch.setenv("VERISPEC_LAYOUT_CACHE", "0")
    assert run({}, {"q4v", "q8v", "q6v"}) == ref
