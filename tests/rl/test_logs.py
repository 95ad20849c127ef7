"""The training loop's CSV logs stay aligned when columns come and go: a column first logged later widens the file
(the rows before it get it empty), a row without one leaves it empty, and a resume cuts the rows after the
checkpoint but keeps the header."""

from __future__ import annotations

import pandas as pd

from moe_replay.rl.logs import append_rows, truncate_rows


def test_a_column_that_appears_later_widens_the_file_and_nothing_is_lost(tmp_path):
    path = tmp_path / "steps.csv"
    append_rows(path, [{"step": 0, "reward": 0.5}, {"step": 1, "reward": 0.25}])
    append_rows(path, [{"step": 2, "kl": 0.125, "reward": 0.75}])  # a new column, in another order
    append_rows(path, [{"step": 3, "reward": 1.0}])  # and a row without it
    table = pd.read_csv(path)
    assert list(table.columns) == ["step", "reward", "kl"]
    assert table["step"].tolist() == [0, 1, 2, 3] and table["reward"].tolist() == [0.5, 0.25, 0.75, 1.0]
    assert table["kl"].isna().tolist() == [True, True, False, True] and table.loc[2, "kl"] == 0.125


def test_truncating_to_a_checkpoint_keeps_the_header_and_the_rows_up_to_it(tmp_path):
    path = tmp_path / "minibatches.csv"
    append_rows(path, [{"step": s, "loss": s / 8} for s in range(4)])
    append_rows(path, [{"step": 4, "loss": 0.5, "grad_norm": 2.0}])
    truncate_rows(path, 1)
    table = pd.read_csv(path)
    assert list(table.columns) == ["step", "loss", "grad_norm"] and table["step"].tolist() == [0, 1]
    append_rows(path, [{"step": 2, "loss": 0.25}])  # the resumed run writes on under the same header
    assert pd.read_csv(path)["step"].tolist() == [0, 1, 2]
    truncate_rows(tmp_path / "missing.csv", 3)  # (no log yet: nothing to cut)
    assert not (tmp_path / "missing.csv").exists()
