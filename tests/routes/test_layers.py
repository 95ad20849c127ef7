"""layers.match_layers: module path (wrapper segments ignored), dotted suffix, then layer order."""

from __future__ import annotations

import pytest

from moe_replay import LayerInfo, ReplayError
from moe_replay.layers import match_layers, plain_name


def held(*names: str, E: int = 8, K: int = 2) -> list[LayerInfo]:
    return [LayerInfo(n, E, K) for n in names]


def test_names_suffixes_wrappers_and_order():
    assert match_layers(["m.layers.0.gate", "m.layers.1.gate"], held("m.layers.1.gate", "m.layers.0.gate"), "M") == {
        "m.layers.1.gate": 0,
        "m.layers.0.gate": 1,
    }
    # a PEFT prefix on either side, and torch's checkpoint / compile segments in the recorded names
    assert match_layers(["base.m.layers.0.gate"], held("m.layers.0.gate"), "M") == {"base.m.layers.0.gate": 0}
    assert match_layers(["m.layers.0.gate"], held("_orig_mod.m.layers.0._checkpoint_wrapped_module.gate"), "M") == {
        "m.layers.0.gate": 0
    }
    assert plain_name("a._fsdp_wrapped_module.b") == "a.b"
    # another engine's names: by order, with E and K checked where the engine knows them
    other = held("decoder.layers.0.mlp.router", "decoder.layers.1.mlp.router")
    assert match_layers(["m.0.gate", "m.1.gate"], other, "M") == {"m.0.gate": 0, "m.1.gate": 1}
    with pytest.raises(ReplayError, match="E=8, K=2 but router 'm.0.gate' has E=16, K=2"):
        match_layers(["m.0.gate", "m.1.gate"], other, "M", {"m.0.gate": (16, 2)})


def test_ambiguous_names_never_fall_back_to_layer_order():
    """`layers.0.mlp.gate` is a suffix of two routers: that is a name match, just an ambiguous one, so the routes do
    not map by order (found by review: the second layer landed on the wrong router)."""
    with pytest.raises(ReplayError, match="route layers without a router"):
        match_layers(
            ["enc.layers.0.mlp.gate", "dec.layers.0.mlp.gate"], held("layers.0.mlp.gate", "layers.1.mlp.gate"), "M"
        )
    with pytest.raises(ReplayError, match="routers without routes"):
        match_layers(["m.0.gate", "m.1.gate"], held("x.0.gate", "x.1.gate", "x.2.gate"), "M")  # counts differ
