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


def test_demo_replays_exactly(capsys, monkeypatch):
    """The demo's sampled routes hold the teacher-forced forward's expert sets at every pair but that forward's
    near-ties (`helpers.near_ties`: float noise between generate's KV-cached decode and the full forward may swap
    those, and then the later MoE layers from there on: helpers.kept_pairs); the demo says so, and
    that replaying them gives its logits bit for bit, unless a near-tie was swapped."""
    import torch
    from helpers import differ, kept_pairs, near_ties

    from moe_replay import find_routers
    from moe_replay.cli import demo

    compared, logits = [], []  # (the demo's first comparison: sampled vs teacher-forced), each router call's logits
    changed, build = demo._changed, demo.tiny_moe
    monkeypatch.setattr(demo, "_changed", lambda a, b: compared.append((a, b)) or changed(a, b))

    def built(seed: int) -> torch.nn.Module:
        model = build(seed)
        for site in find_routers(model):
            site.router.register_forward_hook(lambda m, args, out: logits.append(out[0].detach().clone()))
        return model

    monkeypatch.setattr(demo, "tiny_moe", built)
    figures = demo.run(seed=1)
    out = capsys.readouterr().out
    sampled, forced = compared[0]
    B, T, L, K = sampled.shape
    forward = [x for x in logits if x.shape[0] == B * T][:L]  # the teacher-forced forward's, after generate's
    ties = near_ties(forward, K, (B, T))
    differing = differ(sampled, forced)
    compared = kept_pairs(differing, ties, sampled.mask & forced.mask)
    assert compared.any() and not differing[compared].any()
    same = not differing.any()
    assert f"bit-identical logits: {same}" in out and f"same experts as sampling: {same}" in out
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
