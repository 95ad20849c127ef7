"""pandas views of an `ExpertChange`: a per-layer Series and a tidy frame by layer and position bucket."""

from __future__ import annotations

import pandas as pd
import torch

from .metrics import ExpertChange


def per_layer_series(change: ExpertChange) -> pd.Series:
    """Share of routed choices that differ, per layer, indexed by layer name.

    Example:
        >>> per_layer_series(change).round(3)  # doctest: +SKIP
    """
    return pd.Series(change.layer_fractions().tolist(), index=pd.Index(change.layers, name="layer"), name="fraction")


def change_frame(change: ExpertChange, buckets: int = 4) -> pd.DataFrame:
    """Tidy frame with columns layer, position_bucket, metric, value, tokens.

    `layer` is a layer name or "all"; `position_bucket` is "all" or a range of sequence positions "t0-t1" (`buckets`
    equal-width bins over the compared sequence length); `metric` is fraction, set_changed or token_changed (the
    last only for layer "all"); `tokens` is the number of positions compared.

    Example:
        >>> change_frame(change).query("layer == 'all' and position_bucket == 'all'")  # doctest: +SKIP
    """
    T = change.valid.shape[1]
    edges = torch.linspace(0, T, buckets + 1).round().long().tolist() if buckets > 0 else [0, T]
    spans = [("all", 0, T)] + [(f"{a}-{b - 1}", a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
    rows = []
    for bucket, a, b in spans:
        valid = change.valid[:, a:b]
        n = int(valid.sum())
        if n == 0:
            continue
        part = ExpertChange(change.changed[:, a:b], valid, change.layers, change.top_k, change.label)
        rows.append(("all", bucket, "fraction", part.fraction, n))
        rows.append(("all", bucket, "set_changed", part.set_changed, n))
        rows.append(("all", bucket, "token_changed", part.token_changed, n))
        for name, frac, sets in zip(change.layers, part.layer_fractions(), part.layer_set_changed(), strict=True):
            rows.append((name, bucket, "fraction", float(frac), n))
            rows.append((name, bucket, "set_changed", float(sets), n))
    return pd.DataFrame(rows, columns=["layer", "position_bucket", "metric", "value", "tokens"])
