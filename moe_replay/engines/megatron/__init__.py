"""`record_routes` / `replay_routes` on megatron-core MoE models, through megatron-core's own `RouterReplay`.

megatron-core is imported lazily (the `megatron` extra); docs/megatron.md describes what is covered and refused.

Example:
    >>> from moe_replay.engines.megatron import record_routes, replay_routes  # doctest: +SKIP
    >>> with record_routes(gpt_model) as rec:
    ...     gpt_model(tokens, position_ids, attention_mask)
    >>> with replay_routes(gpt_model, rec.routes):
    ...     gpt_model(tokens, position_ids, attention_mask, labels=labels).mean().backward()
"""

from .context import is_megatron_model
from .cp import CPRoutes, cp_positions, routes_from_cp, routes_to_cp, thd_cp_positions
from .pipeline import gather_pipeline_routes
from .record import MegatronRouteRecorder, record_routes
from .replay import MegatronRouteReplayer, replay_routes
from .routers import INSTALL_HINT, find_routers
from .rows import routes_to_rows, rows_to_routes

__all__ = [
    "CPRoutes",
    "INSTALL_HINT",
    "MegatronRouteRecorder",
    "MegatronRouteReplayer",
    "cp_positions",
    "find_routers",
    "gather_pipeline_routes",
    "is_megatron_model",
    "record_routes",
    "replay_routes",
    "routes_from_cp",
    "routes_to_cp",
    "routes_to_rows",
    "rows_to_routes",
    "thd_cp_positions",
]
