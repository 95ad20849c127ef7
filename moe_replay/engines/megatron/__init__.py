"""`record_routes` / `replay_routes` on megatron-core MoE models, through megatron-core's own `RouterReplay`.

megatron-core is imported lazily (the `megatron` extra); docs/megatron.md describes what is covered and refused. The
context-parallel layouts (`CPRoutes`, `to_cp`, `from_cp`) live in `moe_replay.routes`.

Example:
    >>> from moe_replay.engines.megatron import record_routes, replay_routes  # doctest: +SKIP
    >>> with record_routes(gpt_model) as rec:
    ...     gpt_model(tokens, position_ids, attention_mask)
    >>> with replay_routes(gpt_model, rec.routes):
    ...     gpt_model(tokens, position_ids, attention_mask, labels=labels).mean().backward()
"""

from ...deprecation import moved
from .context import is_megatron_model
from .pipeline import gather_pipeline_routes
from .record import MegatronRouteRecorder, record_routes
from .replay import MegatronRouteReplayer, replay_routes
from .routers import INSTALL_HINT, find_routers
from .rows import from_layer_rows, to_layer_rows

__all__ = [
    "INSTALL_HINT",
    "MegatronRouteRecorder",
    "MegatronRouteReplayer",
    "find_routers",
    "from_layer_rows",
    "gather_pipeline_routes",
    "is_megatron_model",
    "record_routes",
    "replay_routes",
    "to_layer_rows",
]

# deprecated names, one release: each read warns and names its new place
__getattr__ = moved(
    __name__,
    renamed={
        "CPRoutes": "moe_replay.routes.cp.CPRoutes",
        "cp_positions": "moe_replay.routes.cp.cp_positions",
        "thd_cp_positions": "moe_replay.routes.cp.thd_cp_positions",
        "routes_to_cp": "moe_replay.routes.cp.to_cp",
        "routes_from_cp": "moe_replay.routes.cp.from_cp",
        "rows_to_routes": "moe_replay.engines.megatron.rows.from_layer_rows",
        "routes_to_rows": "moe_replay.engines.megatron.rows.to_layer_rows",
    },
)
