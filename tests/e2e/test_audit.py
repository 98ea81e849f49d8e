"""`verispec audit`: lossless configurations pass, a broken verifier is caught, configurations lossy by design
fail as such, bad arguments exit 2 with one line."""

from __future__ import annotations

import json
import re

import pytest
import torch

from verispec import audit, cli
from verispec.sample import step


def _audit(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(["audit", *args, "--quiet"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _draft_cfg(draft: str, **extra) -> str:
    return json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 2, **extra})


def _accept_first(out, n, draft, force):
    """Rows where force and the first draft was rejected accept it instead (the replacement moves one on).
    out: the emitted token [B] (the fused rules' and the greedy rule's result) or the output tokens [B, K+1]
    (rejection_sample's)."""
    if draft.shape[1] == 0:
        return out, n
    force = force & (draft[:, 0] >= 0) & (n == 0)
    if out.dim() == 2:
        out = out.clone()
        out[:, 1] = torch.where(force, out[:, 0], out[:, 1])
        out[:, 0] = torch.where(force, draft[:, 0], out[:, 0])
    return out, torch.where(force, torch.ones_like(n), n)


def _break_verifier(monkeypatch, sampled_only: bool) -> None:
    """A verifier that accepts the first draft whatever the target says, in every row or in sampled rows only:
    the greedy rule (step._greedy, kernel or tensors), the dense sampled rules (step.rejection_sample) and the
    fused kernel's sampled verification (step._fused) alike."""

    def broken(real):
        def wrapper(*args, **kw):
            res = real(*args, **kw)
            # the drafts [B, K]: _greedy's and _fused's third argument, rejection_sample's second
            draft = args[{"_greedy": 2, "rejection_sample": 1, "_fused": 2}[real.__name__]]
            return (
                None if res is None else _accept_first(*res, draft, torch.ones_like(res[1], dtype=torch.bool))
            )

        return wrapper

    # every step through those rules: the host path calls the same kernels (tests/unit/sample/test_step.py)
    monkeypatch.setattr(step, "_host_step", lambda *args, **kw: None)
    names = ("rejection_sample", "_fused") if sampled_only else ("rejection_sample", "_fused", "_greedy")
    for name in names:
        monkeypatch.setattr(step, name, broken(getattr(step, name)))


def test_lossless_config_passes(capsys, tiny_llama, tiny_draft):
    rc, out, err = _audit(
        capsys, tiny_llama, "-sc", _draft_cfg(tiny_draft), "--samples", "600", "--max-tokens", "16"
    )
    assert rc == 0, (out, err)
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["check", "setting", "drafted", "accepted", "verdict"]
    # greedy as configured, greedy with the planner off, sampled law
    assert len(lines) == 4 and all(" pass " in ln for ln in lines[1:])
    cells = [re.split(r"\s{2,}", ln) for ln in lines[1:]]
    assert all(int(c[2]) > 0 for c in cells), cells
    assert "verispec audit: pass" in err


def test_ngram_greedy_only(capsys, tiny_llama):
    cfg = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "enable_adaptive_verification": False})
    rc, out, err = _audit(capsys, tiny_llama, "-sc", cfg, "--samples", "0")
    assert rc == 0, (out, err)
    # the planner is already off: one greedy row, no sampled row
    assert len(out.splitlines()) == 2 and "planner off" in out


def test_broken_verifier_fails_greedy(capsys, monkeypatch, tiny_llama, tiny_draft):
    _break_verifier(monkeypatch, sampled_only=False)
    rc, out, err = _audit(capsys, tiny_llama, "-sc", _draft_cfg(tiny_draft), "--samples", "0")
    assert rc == 1
    assert "FAIL" in out and "FAIL (greedy equality" in err
    assert "prompt 0, output position 1: plain" in err


def test_broken_verifier_fails_sampled_law(capsys, monkeypatch, tiny_llama, tiny_draft):
    """Broken in sampled rows only: the greedy checks pass, the chi-square test must catch it."""
    _break_verifier(monkeypatch, sampled_only=True)
    rc, out, err = _audit(
        capsys, tiny_llama, "-sc", _draft_cfg(tiny_draft), "--samples", "600", "--max-tokens", "8"
    )
    assert rc == 1, (out, err)
    assert out.count(" pass ") == 2
    assert "FAIL (sampled law" in err and "output position 1 (the first speculative position)" in err


LOSSY = [
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.9}, "synthetic"),
    ({"rejection_sample_method": "probabilistic", "enable_entropy_verify": True}, "enable_entropy_verify"),
]


@pytest.mark.parametrize("extra, why", LOSSY)
def test_lossy_configs_fail_as_lossy_by_design(capsys, tiny_llama, tiny_draft, extra, why):
    """The audit says whether a configuration changes the output: one whose law is not the target's by design
    fails (exit 1), its greedy checks passing and its sampled law shown for information."""
    rc, out, err = _audit(
        capsys, tiny_llama, "-sc", _draft_cfg(tiny_draft, **extra), "--samples", "200", "--max-tokens", "8"
    )
    assert rc == 1, (out, err)
    assert "FAIL (output law, by configuration): lossy by design: " in err and why in err
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["output", "law"] and "lossy by design" in lines[1]
    assert out.count(" pass ") == 2 and "lossy by design" in lines[-1]


@pytest.mark.parametrize("samples", ["0", "50"])
def test_lossy_config_fails_even_where_the_sampled_test_passes(capsys, monkeypatch, tiny_llama, samples):
    """The issue's case: synthetic acceptance on ngram at T=1. Whether the chi-square test passes (forced here) or
    is not run at all, the verdict is lossy by design."""
    monkeypatch.setattr(audit, "second_token_test", lambda *args, **kw: (0.9, 40, None))
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "rejection_sample_method": "synthetic"}
    cfg["synthetic_acceptance_rate"] = 0.9
    rc, out, err = _audit(
        capsys,
        tiny_llama,
        "-sc",
        json.dumps(cfg),
        "--temperature",
        "1.0",
        "--samples",
        samples,
        "--max-tokens",
        "8",
    )
    assert rc == 1, (out, err)
    assert "lossy by design: rejection_sample_method 'synthetic'" in err
    assert "verispec audit: pass" not in err


def test_prompts_file(capsys, tmp_path, tiny_llama, tiny_draft):
    """Text lines, {"prompt": ...} and chat messages (a list, or {"messages": [...]}) through the chat template."""
    chat = [{"role": "user", "content": "say a b a b"}]
    f = tmp_path / "p.jsonl"
    lines = ["one two three one two three", "", json.dumps({"prompt": "a b a b a b"}), json.dumps(chat)]
    f.write_text("\n".join([*lines, json.dumps({"messages": chat})]) + "\n")
    rc, out, err = _audit(
        capsys, tiny_llama, "-sc", _draft_cfg(tiny_draft), "--prompts", str(f), "--samples", "0"
    )
    assert rc == 0, (out, err)
    assert "4 prompts x 32 tokens identical" in out
    f.write_text('one\n{"prompt": 3}\n')
    rc, _, err = _audit(capsys, tiny_llama, "-sc", _draft_cfg(tiny_draft), "--prompts", str(f))
    assert rc == 2 and f"{f}:2: expected a text line" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "audit needs a speculative configuration"),
        (["-sc", "{bad"], "speculative_config"),
        (["-sc", '{"method": "ngram"}', "--top-p", "0"], "--top-p"),
        (["-sc", '{"method": "ngram"}', "--samples", "-1"], "--samples"),
        (["-sc", '{"method": "ngram"}', "--prompts", "/nonexistent/p.txt"], "no such file"),
        (["-sc", '{"method": "ngram"}', "--samples", "many"], "--samples"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, tiny_llama, args, needle):
    if "--samples" in args and args[-1] == "many":
        with pytest.raises(SystemExit) as e:
            cli.main(["audit", tiny_llama, *args])
        rc, err = e.value.code, capsys.readouterr().err
    else:
        rc, _, err = _audit(capsys, tiny_llama, *args)
    assert rc == 2 and needle in err and err.count("\n") == 1, err
