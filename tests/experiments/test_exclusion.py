"""Round 4's exclusion rule (experiments/common.py `replace_failed_warm_starts`): a seed whose warm start ends below
0.15 held-out reward per digit is replaced by the next unused seed index, and listed with its reward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
from common import LEARNED, replace_failed_warm_starts  # noqa: E402


def test_seeds_that_learned_are_kept_as_they_are():
    assert LEARNED == pytest.approx(0.15)
    assert replace_failed_warm_starts([0, 1, 2], lambda seed: 0.3) == ([0, 1, 2], {})
    assert replace_failed_warm_starts([0], lambda seed: LEARNED) == ([0], {})  # (below 0.15 only)


def test_a_failed_seed_takes_the_next_unused_index_and_is_listed():
    rewards = {0: 0.3, 1: 0.12, 2: 0.4, 5: 0.01, 6: 0.3, 8: 0.25}
    seeds, replaced = replace_failed_warm_starts([0, 1, 2, 5], rewards.__getitem__, used={7})
    # seed 1 fails: 6, the next index after the largest asked for (5); seed 5 fails: 8 (7 is used elsewhere)
    assert seeds == [0, 6, 2, 8] and replaced == {1: 0.12, 5: 0.01}


def test_a_replacement_that_fails_is_replaced_in_turn():
    rewards = {0: 0.1, 1: 0.3, 2: 0.14, 3: 0.2}
    assert replace_failed_warm_starts([0, 1], rewards.__getitem__) == ([3, 1], {0: 0.1, 2: 0.14})


def test_warm_starts_that_never_learn_stop_with_an_error():
    with pytest.raises(RuntimeError, match="more than 3 warm starts below 0.15"):
        replace_failed_warm_starts([900], lambda seed: 0.1, limit=3)
    assert replace_failed_warm_starts([900], lambda seed: 0.1, threshold=0.0) == ([900], {})
