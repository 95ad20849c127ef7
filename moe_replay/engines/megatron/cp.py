"""Deprecated: the context-parallel layouts moved to `moe_replay.routes.cp` (`routes_to_cp` is `to_cp`, `routes_from_cp`
`from_cp`), `cp_place` to `moe_replay.engines.megatron.context`. Importing this module does not warn; reading a name
here warns (DeprecationWarning) and gives the object at its new place. Removed in the next release.

Example:
    >>> from moe_replay.routes import CPRoutes, from_cp, to_cp  # doctest: +SKIP
"""

from ...deprecation import moved

__getattr__ = moved(
    __name__,
    "moe_replay.routes.cp",
    renamed={
        "routes_to_cp": "moe_replay.routes.cp.to_cp",
        "routes_from_cp": "moe_replay.routes.cp.from_cp",
        "cp_place": "moe_replay.engines.megatron.context.cp_place",
    },
)
