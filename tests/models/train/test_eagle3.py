"""EAGLE-3 training (verispec/train/eagle3.py): the data is the target's, the training forward is the draft the
proposer runs (step 1 and the training-time-test steps), the written checkpoint loads and drafts losslessly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.eagle3_reference import eagle3_reference
from verispec import LLM, SamplingParams
from verispec.train.data import collect
from verispec.train.eagle3 import save, train


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in (12, 20, 7, 30, 16, 9)]
    samples = collect(llm, prompts, 24, (2, 1, 0))
    draft, d2t, history = train(
        samples, llm.ckpt.model, draft_vocab=120, steps=3, epochs=60, lr=3e-3, log_every=0
    )
    folder = tmp_path_factory.mktemp("trained") / "eagle3"
    save(draft, d2t, folder, llm.ckpt.model.cfg, (2, 1, 0))
    return llm, prompts, samples, draft, d2t, history, folder


def test_collected_labels_are_the_targets_greedy_picks(trained):
    llm, prompts, samples, *_ = trained
    h = llm.ckpt.model.cfg.hidden_size
    for p, s in zip(prompts, samples):
        assert s.aux.shape == (len(s.tokens), 3 * h) and s.tokens[: len(p)].tolist() == p
        # on the answer the target's argmax at position i is the token it then emitted at i + 1 (greedy)
        assert s.labels[len(p) - 1 : -1].tolist() == s.tokens[len(p) :].tolist()


def test_training_forward_is_the_draft_the_proposer_runs(trained):
    """Step k's logits at base p equal the block run from scratch on (x_1, aux_0) .. (x_{p+1}, aux_p) followed by
    k - 1 fed-back entries reading x_{p+2} .. x_{p+k}: the proposer's chain after committed position p."""
    llm, _, samples, draft, d2t, _, folder = trained
    w, cfg = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    s = samples[3]
    with torch.no_grad():
        embeds = llm.ckpt.model.embed(s.tokens).float()
        logits = draft.step_logits(embeds, s.aux, 3)
        for p in (0, 5, 17):
            entries = [*s.aux[: p + 1], None, None]
            head_in, _ = eagle3_reference(w, cfg, embeds[1 : p + 4], entries)
            # steps 1, 2, 3 of base p
            ref = head_in[p:] @ w["lm_head.weight"].T
            for k in range(3):
                torch.testing.assert_close(logits[k][p], ref[k], atol=1e-4, rtol=1e-4)
    assert (d2t + torch.arange(len(d2t)) < llm.ckpt.model.cfg.vocab_size).all()


def test_training_lowers_the_loss(trained):
    history = trained[5]
    assert history[-1] < 0.1 * history[0]


def test_written_checkpoint_drafts_losslessly_and_gets_accepted(tiny_llama, trained):
    """The checkpoint loads as method eagle3 (vLLM's format) and, on prompts it was trained on, its drafts are
    accepted while the output stays plain decoding's."""
    llm, prompts, *_, folder = trained
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = LLM(
        tiny_llama,
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3},
    )
    batch = [{"prompt_token_ids": p} for p in prompts]
    outs = spec.generate(batch, sp, use_tqdm=False)
    plain = llm.generate(batch, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = spec.engine.counters.spec
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens


@pytest.mark.parametrize(
    "args, message",
    [
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--draft-vocab", "-5"], "--draft-vocab must be at least 1"),
        (["--positions", "0"], "--positions must be at least 1"),
        (["--activation-dtype", "int4"], "invalid choice: 'int4'"),
        (["--lr", "nan"], "--lr must be positive"),
        (["--model", "/nonexistent/model.gguf"], "error:"),
    ],
)
def test_cli_errors_exit_2_with_one_line(tmp_path, capsys, args, message):
    from verispec.train.eagle3 import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "out"), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_refuses_a_file_as_out(tmp_path, capsys):
    from verispec.train.eagle3 import main

    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "f")])
    assert exc.value.code == 2 and "is a file" in capsys.readouterr().err


def test_training_progress_bar_and_log_lines(trained, monkeypatch, capsys):
    """On a terminal, training draws its bar on stderr (with the loss) and the periodic log lines stay on stdout."""
    from verispec import progress

    llm, _, samples, *_ = trained
    monkeypatch.setattr(progress, "enabled", lambda: True)
    capsys.readouterr()
    train(samples, llm.ckpt.model, draft_vocab=120, steps=2, epochs=1, lr=3e-3, log_every=3)
    std = capsys.readouterr()
    assert "training: 100%" in std.err and f"{len(samples)}/{len(samples)}" in std.err and "loss=" in std.err
    assert f"epoch 0 step 3/{len(samples)} loss" in std.out and "training" not in std.out


def test_interrupted_training_resumes_to_the_same_draft(trained, monkeypatch, tmp_path):
    """Killed right after a saved state, the same call continues from it and ends with the uninterrupted run's
    parameters, bit for bit (the epoch orders follow from the seed; AdamW's moments are saved)."""
    from verispec.train import eagle3

    llm, _, samples, *_ = trained
    kw = dict(draft_vocab=120, steps=2, epochs=2, lr=3e-3, log_every=0, save_every_s=0.0)
    straight, d2t, history = train(samples, llm.ckpt.model, state_dir=tmp_path / "a", **kw)
    save_state, calls = eagle3._save_state, []

    def killed_after_the_fourth(*args):
        save_state(*args)
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(eagle3, "_save_state", killed_after_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        train(samples, llm.ckpt.model, state_dir=tmp_path / "b", **kw)
    monkeypatch.setattr(eagle3, "_save_state", save_state)
    resumed, d2t_b, history_b = train(samples, llm.ckpt.model, state_dir=tmp_path / "b", **kw)
    assert torch.equal(d2t, d2t_b) and history == history_b
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name
    # other data or epochs than the saved run's: a clear error
    with pytest.raises(ValueError, match="remove the folder to start over"):
        train(samples, llm.ckpt.model, state_dir=tmp_path / "b", **{**kw, "epochs": 3})


def test_bf16_training_lowers_the_loss(trained):
    llm, _, samples, *_ = trained
    _, _, history = train(
        samples, llm.ckpt.model, draft_vocab=120, steps=2, epochs=20, lr=3e-3, log_every=0, bf16=True
    )
    assert history[-1] < 0.3 * history[0]


def test_heldout_acceptance_is_the_teacher_forced_greedy_chain(trained):
    """evaluate: the share of bases whose drafts 1..k all match the target's picks; non-increasing in k, high on
    the data the draft learned, and step 1 equal to a direct count."""
    from verispec.train.eagle3 import evaluate

    llm, _, samples, draft, d2t, *_ = trained
    ids = d2t + torch.arange(len(d2t))
    t2d = torch.full((llm.ckpt.model.cfg.vocab_size,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(len(ids))
    acc = evaluate(draft, samples, llm.ckpt.model, t2d, 3)
    assert 1.0 >= acc[0] >= acc[1] >= acc[2] >= 0.0 and acc[0] > 0.5
    hits = bases = 0
    with torch.no_grad():
        for s in samples:
            n = len(s.tokens) - 3
            lg = draft.step_logits(llm.ckpt.model.embed(s.tokens).float(), s.aux, 1)[0]
            hits += int((lg[:n].argmax(-1) == t2d[s.labels[1 : 1 + n]]).sum())
            bases += n
    assert acc[0] == pytest.approx(hits / bases)


def test_training_records_the_learning_curve(trained, tmp_path):
    llm, _, samples, *_ = trained
    train(
        samples,
        llm.ckpt.model,
        draft_vocab=120,
        steps=2,
        epochs=2,
        lr=3e-3,
        log_every=0,
        state_dir=tmp_path,
        eval_samples=samples[:2],
        eval_every=5,
    )
    curve = json.loads((tmp_path / "state.json").read_text())["curve"]
    total = sum(len(s.tokens) for s in samples)
    # after sequences 5 and 10, then at the end (12)
    positions = [c["positions"] for c in curve]
    assert len(curve) == 3 and positions == sorted(set(positions)) and positions[-1] == 2 * total
    assert all(len(c["acceptance"]) == 2 for c in curve)
    assert curve[-1]["acceptance"][0] > curve[0]["acceptance"][0]


def test_q8_0_checkpoint_loads_to_the_blocks_and_drafts_losslessly(tiny_llama, trained, tmp_path):
    """weights="q8_0" writes model.gguf; it loads as method eagle3, every matrix equal to its Q8_0 round trip,
    and drafts losslessly."""
    import gguf

    from verispec.loader.hf import load_hf_tensors

    llm, prompts, _, draft, d2t, *_ = trained
    save(draft, d2t, tmp_path, llm.ckpt.model.cfg, (2, 1, 0), weights="q8_0")
    assert (tmp_path / "model.gguf").exists() and not (tmp_path / "model.safetensors").exists()
    stored, ref = load_hf_tensors(tmp_path), draft.checkpoint(d2t)
    assert stored.keys() == ref.keys()
    assert stored["d2t"].dtype == torch.int32 and torch.equal(stored["d2t"].long(), d2t)
    w = ref["fc.weight"].numpy()
    q8 = gguf.quants.dequantize(
        gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    )
    assert torch.equal(stored["fc.weight"], torch.from_numpy(q8))
    torch.testing.assert_close(stored["norm.weight"], ref["norm.weight"])
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = LLM(
        tiny_llama,
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3},
    )
    batch = [{"prompt_token_ids": p} for p in prompts]
    outs = spec.generate(batch, sp, use_tqdm=False)
    plain = llm.generate(batch, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.counters.spec.num_accepted_tokens > 0


def test_answers_start_after_the_chat_templates_generation_prompt(tiny_llama):
    """mark_answers finds where each answer starts; training and the held-out score only count its tokens."""
    from verispec.train.data import Sample
    from verispec.train.eagle3 import answer_marker, mark_answers

    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=1)
    tok = llm.tokenizer
    marker = answer_marker(tok)
    assert marker
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hello there"}]), add_special_tokens=False
    )
    answer = [5, 6, 7]
    s = Sample(torch.tensor(prompt + answer), torch.zeros(len(prompt) + 3, 6), torch.zeros(len(prompt) + 3))
    raw = Sample(torch.tensor(answer * 3), torch.zeros(9, 6), torch.zeros(9))
    mark_answers([s, raw], marker)
    assert s.start == len(prompt) and raw.start == 0


def test_heldout_score_counts_answer_bases_only(trained):
    """Moving a sample's start past its last base removes it from the score; the other samples' score stays."""
    from verispec.train.eagle3 import evaluate

    llm, _, samples, draft, d2t, *_ = trained
    ids = d2t + torch.arange(len(d2t))
    t2d = torch.full((llm.ckpt.model.cfg.vocab_size,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(len(ids))
    rest = samples[1:]
    alone = evaluate(draft, rest, llm.ckpt.model, t2d, 2)
    first = samples[0]
    hidden = type(first)(first.tokens, first.aux, first.labels, start=len(first.tokens))
    assert evaluate(draft, [hidden, *rest], llm.ckpt.model, t2d, 2) == alone


def test_a_corrupt_training_state_is_a_clear_error(trained, tmp_path):
    llm, _, samples, *_ = trained
    (tmp_path / "state.json").write_text("{}")
    (tmp_path / "state.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable training state"):
        train(samples, llm.ckpt.model, draft_vocab=120, steps=2, epochs=1, state_dir=tmp_path, log_every=0)


def test_a_written_draft_scores_as_it_was_trained(trained, tmp_path):
    """load_trainable: a float32 draft folder reads back into the same parameters (the same held-out score); the
    Q8_0 folder reads back its dequantized blocks."""
    from safetensors.torch import save_file

    from verispec.train.eagle3 import evaluate, load_trainable

    llm, _, samples, draft, d2t, _, folder = trained
    model = llm.ckpt.model
    loaded, t2d = load_trainable(folder, model.cfg)
    for name, p in draft.named_parameters():
        assert torch.equal(getattr(loaded, name), p), name
    ids = d2t + torch.arange(len(d2t))
    assert torch.equal(t2d[ids], torch.arange(len(ids)))
    assert evaluate(loaded, samples, model, t2d, 3) == evaluate(draft, samples, model, t2d, 3)
    save(draft, d2t, tmp_path, model.cfg, (2, 1, 0), weights="q8_0")
    q8, _ = load_trainable(tmp_path, model.cfg)
    torch.testing.assert_close(q8.fc, draft.fc, atol=0.02, rtol=0.02)
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        load_trainable(tmp_path / "missing", model.cfg)
    (tmp_path / "model.gguf").unlink()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="not an EAGLE-3 draft"):
        load_trainable(tmp_path, model.cfg)
