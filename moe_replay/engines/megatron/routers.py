"""Find a megatron-core model's routers, refuse the configurations replay cannot act on, and place each router in
the whole model: under pipeline parallelism a stage (or a virtual-pipeline chunk) holds only some layers and numbers
its modules locally, so every router is named by its global layer number and knows its global MoE-layer index.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import UnsupportedModelError
from ...routes import LayerInfo
from ..recompute_queue import RecomputeQueue

TESTED_MEGATRON = ("0.16", "0.20")  # megatron-core >= 0.16, < 0.20: 0.16.1 and 0.19.2 tested, 0.17-0.18 in between
TESTED_RANGE = tuple(tuple(int(x) for x in bound.split(".")) for bound in TESTED_MEGATRON)  # ((0, 16), (0, 20))
MAJOR_MINOR = re.compile(r"(\d+)\.(\d+)")
INSTALL_HINT = "pip install 'moe-replay[megatron]' (megatron-core >= 0.16, < 0.20)"


def megatron_api() -> tuple[type, Any]:
    """(TopKRouter, RouterReplayAction) of a megatron-core in the tested range (`check_version`), or an ImportError
    that says how to install it."""
    try:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplayAction
    except ImportError as e:
        raise ImportError(f"moe_replay.engines.megatron needs megatron-core with RouterReplay: {INSTALL_HINT}") from e
    from megatron.core.package_info import __version__

    check_version(__version__)
    return TopKRouter, RouterReplayAction


def check_version(installed: str) -> None:
    """Raise ImportError, naming both, unless megatron-core `installed` is in the range this engine is tested with
    (`TESTED_MEGATRON`); `MOE_REPLAY_MEGATRON_UNTESTED=1` makes it a warning. Asked when a context first meets a
    megatron-core model, never at import (the importers and Hugging Face users may have another megatron installed).

    Example:
        >>> check_version("0.19.2")
    """
    if in_tested_range(installed):
        return
    low, high = TESTED_MEGATRON
    message = (
        f"moe-replay's Megatron engine is tested with megatron-core>={low},<{high} (0.16.1 and 0.19.2) but "
        f"megatron-core {installed} is installed: {INSTALL_HINT}, or set MOE_REPLAY_MEGATRON_UNTESTED=1 to try it"
    )
    if os.environ.get("MOE_REPLAY_MEGATRON_UNTESTED") != "1":
        raise ImportError(message)
    warnings.warn(message, stacklevel=3)


def in_tested_range(installed: str) -> bool:
    """Whether megatron-core version `installed` is in `TESTED_MEGATRON`, by its major and minor numbers (a
    pre-release counts as its release); a version that does not start with them is not.

    Example:
        >>> in_tested_range("0.19.2"), in_tested_range("0.20.0rc1"), in_tested_range("dev")
        (True, False, False)
    """
    found = MAJOR_MINOR.match(installed)
    return found is not None and TESTED_RANGE[0] <= (int(found[1]), int(found[2])) < TESTED_RANGE[1]


@dataclass
class Site:
    """One router of the model and the replay bookkeeping of the open context."""

    name: str  # module path, with the layer index made global under pipeline parallelism
    router: nn.Module
    info: LayerInfo
    chunk: int = 0  # which of the given modules (virtual-pipeline chunks) holds it
    position: int = 0  # global MoE-layer index: its column in the whole model's Routes
    saved: tuple = ()
    pending: RecomputeQueue = field(init=False)  # its calls awaiting recompute, routes (rows, mask) each
    mask: torch.Tensor | None = None  # [S_local * B] bool for the current call (False: route live; None: all)
    track: bool = False  # the current call compares its live pick with the replayed one (track_live)
    column: int = 0  # the current call's layer column in its routes
    used: bool = False

    def __post_init__(self) -> None:
        # (megatron's RouterReplay pops its rows as a recompute takes them: none kept for a second one)
        self.pending = RecomputeQueue(self.name, same_rows, keep_done=0)


def same_rows(a: tuple, b: tuple) -> bool:
    """Whether two queued calls replayed the same (rows, mask) (`RecomputeQueue.same`)."""
    (rows, mask), (other, other_mask) = a, b
    if rows.shape != other.shape or not torch.equal(rows, other) or (mask is None) != (other_mask is None):
        return False
    return mask is None or torch.equal(mask, other_mask)


MTP_LAYER = re.compile(r"(?:^|\.)mtp\.layers\.\d+\.")


def is_mtp(name: str) -> bool:
    """Whether a router belongs to a multi-token-prediction layer (`mtp.layers.<i>.`), which rollout engines do not
    run: their routes hold no column for it.

    Example:
        >>> is_mtp("mtp.layers.0.transformer_layer.mlp.router"), is_mtp("decoder.layers.0.mlp.router")
        (True, False)
    """
    return MTP_LAYER.search(name) is not None


def pipelined(config: Any) -> bool:
    """Whether a model config splits the layers over pipeline stages (or virtual-pipeline chunks).

    Example:
        >>> from types import SimpleNamespace
        >>> pipelined(SimpleNamespace(pipeline_model_parallel_size=2))
        True
    """
    return (getattr(config, "pipeline_model_parallel_size", 1) or 1) > 1 or bool(
        getattr(config, "virtual_pipeline_model_parallel_size", None)
    )


def moe_pattern(config: Any) -> list[int]:
    """1 for each of the whole model's `num_layers` decoder layers that is an MoE layer (`moe_layer_freq`), else 0.

    Example:
        >>> from types import SimpleNamespace
        >>> moe_pattern(SimpleNamespace(num_layers=4, moe_layer_freq=2))
        [1, 0, 1, 0]
    """
    freq, n = getattr(config, "moe_layer_freq", 1), int(config.num_layers)
    pattern = [int(i % freq == 0) for i in range(n)] if isinstance(freq, int) else [int(x) for x in freq]
    if len(pattern) != n:
        raise UnsupportedModelError(f"moe_layer_freq lists {len(pattern)} layers but num_layers is {n}")
    return pattern


def total_moe_layers(sites: Sequence[Site]) -> int:
    """How many MoE layers the whole model has (all pipeline stages together).

    Example:
        >>> total_moe_layers(find_routers(stage_model))  # doctest: +SKIP
        48
    """
    config = sites[0].router.config
    return sum(moe_pattern(config)) if pipelined(config) else len(sites)


def _global_name(name: str, module: nn.Module, pattern: list[int]) -> tuple[str, int]:
    """A stage's router path with its local layer index replaced by the global one, and its global MoE index."""
    number = getattr(module, "layer_number", None)
    parts = name.split(".")
    at = [i for i in range(1, len(parts)) if parts[i - 1] == "layers" and parts[i].isdigit()]
    if not isinstance(number, int) or not at or not 1 <= number <= len(pattern) or not pattern[number - 1]:
        raise UnsupportedModelError(
            f"router {name!r} (layer_number={number}) cannot be placed among the whole model's "
            f"{sum(pattern)} MoE layers (moe_layer_freq) under pipeline parallelism, e.g. a multi-token-prediction "
            "layer: its routes cannot be recorded or replayed"
        )
    parts[at[-1]] = str(number - 1)
    return ".".join(parts), sum(pattern[: number - 1])


def refusal(module: nn.Module, name: str) -> str | None:
    """Why replay cannot act on router `name` (a `TopKRouter` with its `config`), or None.

    Example:
        >>> refusal(router, "decoder.layers.0.mlp.router")  # doctest: +SKIP
        "moe_router_fusion=True (the fused top-k bypasses RouterReplay)"
    """
    config = module.config
    refused = {
        "moe_router_fusion=True (the fused top-k bypasses RouterReplay)": getattr(config, "moe_router_fusion", False),
        "moe_router_load_balancing_type='sinkhorn' (sinkhorn routing bypasses RouterReplay)": getattr(
            module, "routing_type", None
        )
        == "sinkhorn",
        "CUDA graphs (a captured router skips the replay hooks)": getattr(config, "cuda_graph_impl", "none")
        not in ("none", None)
        or getattr(config, "enable_cuda_graph", False),
        "hybrid_context_parallel=True (each micro-batch picks its own CP groups)": getattr(
            config, "hybrid_context_parallel", False
        ),
        "moe_router_force_load_balancing=True (random logits for benchmarks)": getattr(
            config, "moe_router_force_load_balancing", False
        ),
        # megatron-core 0.19: quantile balancing passes its own indices (precomputed_indices), skipping RouterReplay;
        # a forced bias adds random logits per forward; a repeated MTP layer runs its router mtp_num_layers times
        "moe_router_load_balancing_type='quantile_balancing' (its precomputed indices bypass RouterReplay)": getattr(
            module, "routing_type", None
        )
        == "quantile_balancing",
        "moe_router_force_biased set (a random logit bias per forward)": getattr(
            config, "moe_router_force_biased", None
        )
        is not None,
        "mtp_use_repeated_layer=True (one multi-token-prediction layer runs its router mtp_num_layers times per "
        "forward)": is_mtp(name)
        and getattr(config, "mtp_use_repeated_layer", False)
        and (getattr(config, "mtp_num_layers", None) or 1) > 1,
    }
    return next((what for what, on in refused.items() if on), None)


def find_routers(model: nn.Module | Sequence[nn.Module]) -> list[Site]:
    """The `TopKRouter`s of a megatron-core model (or of a pipeline rank's virtual-pipeline chunks, a list), in
    whole-model layer order, after checking that replay can act on every one of them.

    Under pipeline parallelism each router is named with its global layer number (`decoder.layers.5.mlp.router` on
    the stage that holds layer 5 as its local layer 1) and knows its global MoE-layer index (`site.position`).
    Raises ValueError for a model without routers, routers built without `moe_enable_routing_replay`, and the
    configurations in which megatron-core would skip replay silently (fused routing, sinkhorn, quantile balancing, CUDA
    graphs), route at random (forced load balancing or bias), run a router several times (a repeated MTP layer) or
    split the sequence in groups that change per micro-batch (hybrid context parallelism).

    Example:
        >>> [site.name for site in find_routers(gpt_model)]  # doctest: +SKIP
        ['decoder.layers.0.mlp.router', 'decoder.layers.1.mlp.router']
    """
    top_k_router, _ = megatron_api()
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    sites = []
    for chunk, module_tree in enumerate(chunks):
        for name, module in module_tree.named_modules():
            if not isinstance(module, top_k_router):
                continue
            if getattr(module, "router_replay", None) is None:
                raise UnsupportedModelError(
                    f"router {name!r} has no RouterReplay: build the model with "
                    "TransformerConfig(..., moe_enable_routing_replay=True) to record or replay its routes"
                )
            why = refusal(module, name)
            if why:
                raise UnsupportedModelError(f"router {name!r}: routes cannot be recorded or replayed with {why}")
            position, full = len(sites), name
            if pipelined(module.config):
                full, position = _global_name(name, module, moe_pattern(module.config))
            info = LayerInfo(full, int(module.config.num_moe_experts), int(module.topk))
            sites.append(Site(full, module, info, chunk=chunk, position=position))
    if not sites:
        owner = " + ".join(type(m).__name__ for m in chunks)
        stage = " (a pipeline stage whose layers are all dense?)" if chunks and _any_pipelined(chunks) else ""
        raise UnsupportedModelError(f"{owner} has no megatron-core MoE router (TopKRouter){stage}: nothing to record")
    sites.sort(key=lambda s: s.position)
    dupes = sorted({s.name for s in sites if sum(t.position == s.position or t.name == s.name for t in sites) > 1})
    if dupes:
        raise UnsupportedModelError(
            f"routers {dupes} appear twice (or claim the same global MoE layer): a list of modules is one pipeline "
            "rank's virtual-pipeline chunks, each given once"
        )
    return sites


def _any_pipelined(chunks: Sequence[nn.Module]) -> bool:
    config = getattr(chunks[0], "config", None)
    return config is not None and pipelined(config)
