"""Which columns of a `Routes` a pipeline stage's routers replay (whole model's routes or the stage's part, by name or
by layer order), and the refusals that keep another stage's routes from being replayed by order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core.transformer.moe.router_replay", reason="needs the [megatron] extra")

from helpers import free_port  # noqa: E402
from megatron_utils import batch, megatron_cpu, tiny_gpt  # noqa: E402

import moe_replay  # noqa: E402
from moe_replay import LayerInfo, ReplayError  # noqa: E402
from moe_replay.engines.megatron.pipeline import stage_columns  # noqa: E402
from moe_replay.engines.megatron.routers import Site  # noqa: E402

CONFIG = SimpleNamespace(num_layers=4, moe_layer_freq=[1, 1, 0, 1], pipeline_model_parallel_size=2)


def stage(*layers: tuple[int, int]) -> list[Site]:
    """Sites of a stage holding decoder layers (global layer index, global MoE index), 4 experts, top-2."""
    router = SimpleNamespace(config=CONFIG)
    return [
        Site(f"decoder.layers.{g}.mlp.router", router, LayerInfo(f"decoder.layers.{g}.mlp.router", 4, 2), position=p)
        for g, p in layers
    ]


def columns(sites: list[Site], names: list[str], experts: int = 4) -> dict[str, int]:
    shapes = {s.name: (4, 2) for s in sites}
    return stage_columns(sites, [LayerInfo(n, experts, 2) for n in names], "GPTModel", shapes)


MEGATRON = [f"decoder.layers.{g}.mlp.router" for g in (0, 1, 3)]
HF = [f"model.layers.{g}.mlp.gate" for g in (0, 1, 3)]  # as transformers names the same model's routers
LAST, FIRST = stage((3, 2)), stage((0, 0), (1, 1))


def test_whole_model_routes_give_a_stage_its_global_columns_by_name_or_by_order():
    assert columns(LAST, MEGATRON) == {"decoder.layers.3.mlp.router": 2}
    assert columns(FIRST, MEGATRON) == {"decoder.layers.0.mlp.router": 0, "decoder.layers.1.mlp.router": 1}
    assert columns(LAST, list(reversed(MEGATRON))) == {"decoder.layers.3.mlp.router": 0}  # names decide, not order
    assert columns(LAST, ["module." + n for n in MEGATRON]) == {"decoder.layers.3.mlp.router": 2}  # a DDP wrapper
    assert columns(LAST, HF) == {"decoder.layers.3.mlp.router": 2}  # another engine: the global MoE index
    assert columns(FIRST, HF) == {"decoder.layers.0.mlp.router": 0, "decoder.layers.1.mlp.router": 1}


def test_a_stage_replays_its_own_part():
    assert columns(LAST, ["decoder.layers.3.mlp.router"]) == {"decoder.layers.3.mlp.router": 0}
    assert columns(FIRST, MEGATRON[:2]) == {"decoder.layers.0.mlp.router": 0, "decoder.layers.1.mlp.router": 1}
    assert columns(LAST, ["model.layers.3.mlp.gate"]) == {"decoder.layers.3.mlp.router": 0}  # by order


def test_another_stages_routes_or_a_wrong_layer_count_are_refused():
    with pytest.raises(ReplayError, match=r"other layers of this model \(another stage's part\?\)"):
        columns(LAST, ["decoder.layers.1.mlp.router"])  # one layer, like the stage: by order would be silent
    with pytest.raises(ReplayError, match=r"routes hold 2 layers .* 1 of the model's 3 MoE layers .* \(3 layers\)"):
        columns(LAST, HF[:2])
    with pytest.raises(ReplayError, match=r"'model.layers.2.mlp.gate' \(decoder layer 2\) would replay on .* 3\)"):
        columns(LAST, ["model.layers.2.mlp.gate"])  # by order, but the layer numbers disagree
    with pytest.raises(ReplayError, match="E=8, K=2 but router 'decoder.layers.3.mlp.router' has E=4, K=2"):
        columns(LAST, MEGATRON, experts=8)


def test_a_list_of_modules_is_one_ranks_chunks():
    with megatron_cpu(port=free_port()):
        model = tiny_gpt()
        tokens, pos, mask, _ = batch()
        with moe_replay.record_routes([model]) as rec:  # a one-chunk list is the model
            logits = model(tokens, pos, mask)
        with moe_replay.replay_routes([model], rec.routes):
            assert torch.equal(model(tokens, pos, mask), logits)
        with pytest.raises(ValueError, match="appear twice"):
            moe_replay.record_routes([model, model]).__enter__()
        with pytest.raises(ValueError, match="non-empty list"):
            moe_replay.engines.megatron.record_routes([]).__enter__()
        with pytest.raises(ValueError, match="got list; a list of modules is accepted only as a megatron-core"):
            moe_replay.record_routes([torch.nn.Linear(2, 2)])
