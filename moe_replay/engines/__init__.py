"""Model runtimes whose routers moe-replay hooks: Hugging Face transformers (`hf`) and megatron-core (`megatron`).

`record_routes` / `replay_routes` here (and at the top level) dispatch on the model: megatron-core's RouterReplay for a
megatron-core model, the Hugging Face hooks for any other.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..routes import Packed, PackedRoutes, Routes
from . import hf, megatron
from .packed import PackedReplayer


def record_routes(model: nn.Module | Sequence[nn.Module]) -> hf.RouteRecorder | megatron.MegatronRouteRecorder:
    """Record the experts every router of `model` selects while the context is open; `.routes` is a `Routes`
    [B, T, L, K]. A transformers model uses `moe_replay.engines.hf.record_routes` (works under `generate`), a
    megatron-core model (or a pipeline rank's list of virtual-pipeline chunks)
    `moe_replay.engines.megatron.record_routes`.

    Example:
        >>> with record_routes(model) as rec:  # doctest: +SKIP
        ...     out = model.generate(**batch, do_sample=True, return_dict_in_generate=True)
        >>> routes = rec.routes
    """
    if megatron.is_megatron_model(model):
        return megatron.record_routes(model)
    return hf.record_routes(_one_module(model))


def replay_routes(
    model: nn.Module | Sequence[nn.Module], routes: Routes | Sequence[Routes] | Packed, *, track_live: bool = False
) -> hf.RouteReplayer | megatron.MegatronRouteReplayer | PackedReplayer:
    """Force every router of `model` to select the experts in `routes` while the context is open (forward, and
    the recompute of the backward), with router weights and gradients computed live. Dispatches like
    `record_routes`; a list of `Routes` (one per micro-batch forward), and a list of modules (a pipeline rank's
    virtual-pipeline chunks), are for megatron-core models. `track_live` also counts how many replayed experts live
    routing would have changed (`ctx.live_moved()`). A packed row's routes (`to_packed(...)` or its `.routes`)
    replay only on forwards that run the row as those packed sequences (transformers: restarting `position_ids`, no
    attention mask, no cache; megatron-core: `PackedSeqParams` of the same boundaries), refusing any other before it
    runs.

    Example:
        >>> with replay_routes(model, routes):  # doctest: +SKIP
        ...     loss = loss_fn(model(sequences).logits)
        ...     loss.backward()
        >>> with replay_routes(model, to_packed(routes, attention_mask)):  # doctest: +SKIP
        ...     model(row, position_ids=restarting, use_cache=False)
    """
    if isinstance(routes, Packed):  # (a tuple: before the list-of-Routes case)
        routes = routes.routes
    if isinstance(routes, PackedRoutes):
        if not isinstance(model, nn.Module):
            raise ValueError("packed routes replay on one model (a megatron-core pipeline's chunks take plain Routes)")
        plain = Routes._trusted(routes.indices, routes.mask, routes.layers)
        inner = replay_routes(model, plain, track_live=track_live)
        return PackedReplayer(model, routes, inner, megatron=isinstance(inner, megatron.MegatronRouteReplayer))
    if megatron.is_megatron_model(model):
        return megatron.replay_routes(model, routes, track_live=track_live)
    return hf.replay_routes(_one_module(model), routes, track_live=track_live)


def _one_module(model: object) -> nn.Module:
    """`model`, or a ValueError if it is not a module (a list is only for megatron-core's virtual-pipeline chunks)."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"expected a model (torch.nn.Module), got {type(model).__name__}; a list of modules is accepted only as "
            "a megatron-core pipeline rank's virtual-pipeline chunks"
        )
    return model
