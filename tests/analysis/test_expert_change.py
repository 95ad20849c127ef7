"""expert_change: hand-computed cases, a plain-Python reference, tables and figures."""

from __future__ import annotations

import matplotlib.image as mpimg
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_replay import LayerInfo, Routes, expert_change
from moe_replay.analysis import plots


def routes(idx, mask=None, E=8, names=None) -> Routes:
    idx = torch.as_tensor(idx)
    B, T, L, K = idx.shape
    mask = torch.ones(B, T, dtype=torch.bool) if mask is None else torch.as_tensor(mask)
    names = names or [f"model.layers.{i}.mlp.gate" for i in range(L)]
    return Routes(idx, mask, [LayerInfo(n, E, K) for n in names])


def test_identical_is_zero_and_disjoint_is_one():
    a = routes([[[[0, 1], [2, 3]]]])
    assert expert_change(a, a).fraction == 0.0
    b = routes([[[[4, 5], [6, 7]]]])
    c = expert_change(a, b)
    # every slot differs in both layers: fraction 1, every set changed, the one token changed
    assert (c.fraction, c.set_changed, c.token_changed) == (1.0, 1.0, 1.0)


def test_one_slot_changed_is_one_over_k():
    # K = 4, one token, one layer: {0,1,2,3} -> {0,1,2,7}: |A∩B| = 3, so 1 - 3/4 = 0.25
    c = expert_change(routes([[[[0, 1, 2, 3]]]]), routes([[[[0, 1, 2, 7]]]]))
    assert c.fraction == 0.25 and c.set_changed == 1.0


def test_order_within_k_does_not_matter():
    assert expert_change(routes([[[[0, 1, 2]]]]), routes([[[[2, 0, 1]]]])).fraction == 0.0


def test_masked_positions_are_skipped():
    # position 1 differs completely but is masked in `after`: only position 0 (identical) counts
    a = routes([[[[0, 1]], [[2, 3]]]])
    b = routes([[[[0, 1]], [[4, 5]]]], mask=[[True, False]])
    c = expert_change(a, b)
    assert c.num_tokens == 1 and c.fraction == 0.0


def test_per_layer_sums_back_with_equal_token_weights():
    # 2 tokens x 2 layers, K = 2. Layer 0: token 0 one slot changed (1/2), token 1 none -> layer fraction 1/4.
    # Layer 1: token 0 both changed (1), token 1 one slot (1/2) -> 3/4. Overall = (1/4 + 3/4) / 2 = 1/2.
    a = routes([[[[0, 1], [0, 1]], [[2, 3], [2, 3]]]])
    b = routes([[[[0, 5], [6, 7]], [[3, 2], [2, 7]]]])
    c = expert_change(a, b)
    assert c.per_layer.tolist() == [0.25, 0.75]
    assert c.fraction == 0.5 == c.per_layer.mean()
    assert c.set_changed == 3 / 4  # 3 of 4 (token, layer) pairs changed
    assert c.token_changed == 1.0  # both tokens changed somewhere


def test_k_equals_e_and_k_one():
    full = routes([[[[0, 1, 2, 3]]]], E=4)
    assert expert_change(full, routes([[[[3, 2, 1, 0]]]], E=4)).fraction == 0.0  # K = E: nothing can change
    assert expert_change(routes([[[[1]]]]), routes([[[[2]]]])).fraction == 1.0


def test_mismatched_routes_name_the_difference():
    a = routes([[[[0, 1]]]])
    with pytest.raises(ValueError, match=r"before has \[B, T, L, K\] = \[1, 1, 1, 2\], after has \[1, 2, 1, 2\]"):
        expert_change(a, routes([[[[0, 1]], [[0, 1]]]]))
    with pytest.raises(ValueError, match="different layers"):
        expert_change(a, routes([[[[0, 1]]]], names=["other"]))
    with pytest.raises(ValueError, match="num_experts=8.* vs .*num_experts=300"):  # found by review: compared
        expert_change(routes([[[[0, 1]]]], E=8), routes([[[[0, 1]]]], E=300))
    with pytest.raises(ValueError, match="no position is recorded in both"):
        expert_change(a, routes([[[[0, 1]]]], mask=[[False]]))
    none = Routes(torch.zeros(1, 1, 0, 2, dtype=torch.uint8), torch.ones(1, 1, dtype=torch.bool), [])
    with pytest.raises(ValueError, match=r"no layers \(L = 0\)"):  # found by review: a NaN fraction
        expert_change(none, none)


def reference(a: Routes, b: Routes) -> tuple[float, float, float]:
    """Plain-Python loops: the definitions, one token and layer at a time."""
    B, T, L, K = a.shape
    slots = sets = tokens = n = 0
    for i in range(B):
        for t in range(T):
            if not (a.mask[i, t] and b.mask[i, t]):
                continue
            n += 1
            any_changed = False
            for layer in range(L):
                x, y = set(a.indices[i, t, layer].tolist()), set(b.indices[i, t, layer].tolist())
                slots += K - len(x & y)
                sets += x != y
                any_changed |= x != y
            tokens += any_changed
    return slots / (n * L * K), sets / (n * L), tokens / n


@st.composite
def route_pairs(draw):
    B, T, L = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    E = draw(st.integers(1, 9))
    K = draw(st.integers(1, E))
    seed = draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)

    def draw_routes(p_mask):
        idx = torch.rand(B, T, L, E, generator=g).argsort(-1)[..., :K]
        mask = torch.rand(B, T, generator=g) < p_mask
        mask[0, 0] = True
        return routes(idx, mask, E=E)

    a = draw_routes(0.8)
    b = draw_routes(0.8)
    keep = torch.rand(B, T, L, generator=g) < 0.5  # make about half the sets equal to `a`
    b = Routes(torch.where(keep[..., None], a.indices, b.indices), b.mask | a.mask, b.layers)
    return a, b


@settings(max_examples=60, deadline=None)
@given(route_pairs())
def test_matches_plain_python_reference(pair):
    a, b = pair
    c = expert_change(a, b)
    frac, sets, tokens = reference(a, b)
    assert c.fraction == pytest.approx(frac, abs=1e-12)
    assert c.set_changed == pytest.approx(sets, abs=1e-12)
    assert c.token_changed == pytest.approx(tokens, abs=1e-12)


def test_frame_is_tidy_and_consistent():
    g = torch.Generator().manual_seed(0)
    a = routes(torch.rand(3, 16, 2, 8, generator=g).argsort(-1)[..., :2])
    b = routes(torch.rand(3, 16, 2, 8, generator=g).argsort(-1)[..., :2])
    c = expert_change(a, b)
    f = c.to_frame(buckets=4)
    assert list(f.columns) == ["layer", "position_bucket", "metric", "value", "tokens"]
    overall = f.query("layer == 'all' and position_bucket == 'all'").set_index("metric")["value"]
    assert overall["fraction"] == c.fraction and overall["token_changed"] == c.token_changed
    assert set(f.position_bucket) == {"all", "0-3", "4-7", "8-11", "12-15"}
    # the buckets split the tokens: their token-weighted fractions average back to the whole
    parts = f.query("layer == 'all' and metric == 'fraction' and position_bucket != 'all'")
    assert (parts.value * parts.tokens).sum() / parts.tokens.sum() == pytest.approx(c.fraction)


def test_figures_render_with_labels(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = routes(torch.rand(2, 6, 3, 8, generator=g).argsort(-1)[..., :2])
    b = routes(torch.rand(2, 6, 3, 8, generator=g).argsort(-1)[..., :2])
    fig = plots.per_layer(expert_change(a, b))
    ax = fig.axes[0]
    assert ax.get_xlabel() == "MoE layer" and ax.get_ylabel() == "changed (%)" and "before vs after" in ax.get_title()
    path = tmp_path / "per_layer.png"
    fig.savefig(path)
    assert path.stat().st_size > 1000 and mpimg.imread(path).shape[2] in (3, 4)

    import pandas as pd

    frame = pd.DataFrame(
        [
            {"arm": arm, "seed": s, "step": t, "value": t * (1 + s) / 10}
            for arm in "ab"
            for s in range(3)
            for t in range(5)
        ]
    )
    fig = plots.over_training(frame, ylabel="expert change", percent=True)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "expert change (%)" and "3 seeds" in ax.get_title()
    assert len(ax.lines) == 2 and len(ax.collections) == 2  # a mean line and a band per arm
    fig.savefig(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="column 'reward' not in the frame"):
        plots.over_training(frame, y="reward")
