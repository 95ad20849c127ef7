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
