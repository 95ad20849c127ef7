"""The command line: --version, --help and the demo."""

from __future__ import annotations

import pytest

from moe_replay import __version__
from moe_replay.cli import main


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out
    assert main([]) == 0 and "demo" in capsys.readouterr().out


def test_demo_replays_exactly(capsys):
    from moe_replay.cli.demo import run

    figures = run(seed=1)
    out = capsys.readouterr().out
    assert "bit-identical logits: True" in out and "same experts as sampling: True" in out
    assert figures["changed_with_replay"] == 0.0 < figures["changed_without_replay"]


def test_drift_prompts_are_right_padded_so_that_columns_are_positions(tmp_path, monkeypatch):
    """`drift --prompts` buckets by position: with a left-padding tokenizer (a model's saved setting) its columns were
    not the tokens' positions (found by review)."""
    import argparse

    import transformers

    from moe_replay.cli.drift import _batch
    from moe_replay.tiny import tiny_moe, tiny_tokenizer

    tok = tiny_tokenizer()
    tok.padding_side = "left"
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tok)
    (tmp_path / "prompts.txt").write_text("1+2=3\nab\n12345+6=\n")
    args = argparse.Namespace(prompts=tmp_path / "prompts.txt", model=str(tmp_path), length=16, device="cpu")
    ids, mask = _batch(args, tiny_moe(0))
    assert mask[:, 0].all() and not mask[:, -1].all()  # every row starts at column 0; the shorter ones are padded


@pytest.mark.parametrize(
    "text, message",
    [
        ('steps = 5\nreplay = "rollout\n', "line 3, column 18: not valid TOML"),  # a TOML syntax error
        ("steps = 5\n[policy]\nnum_expert = 8\n", "did you mean 'num_experts'"),  # an unknown [policy] key
        ("max_grad_norm = -1.0\n", "max_grad_norm must be > 0, got -1.0"),  # a setting that trains backwards
        ('partial_credit = "false"\n', "partial_credit must be a bool, got 'false'"),
    ],
)
def test_train_config_errors_are_usage_errors(tmp_path, capsys, text, message):
    """`moe-replay train --config bad.toml`: `error: ...` naming the file, exit status 2, no traceback, no run."""
    path = tmp_path / "bad.toml"
    path.write_text(f'output = "{tmp_path / "run"}"\n' + text)
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(path), "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"moe-replay train: error: {path}") and message in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
