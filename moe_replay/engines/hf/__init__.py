"""Record and replay router choices on Hugging Face transformers MoE models: what a user calls.

Layout (docs/design.md walks one router call through it): `discover` finds the routers and `declared` says which
classes take the fast path; `hub` holds the hooks of one model (`patch`); each `router`'s wrappers run its calls
(`call`), whose experts are picked by its `selectors` (`sparsemixer` for PhiMoE); `steps`, `tracker` and
`generation` place each forward's tokens; `record` and `replay` are the contexts.
"""

from ...errors import ReplayError, UnsupportedGenerationError, UnsupportedModelError
from .discover import UNSUPPORTED, RouterSite, find_routers
from .hub import open_contexts
from .record import RouteRecorder, record_routes
from .replay import RouteReplayer, replay_routes
from .warm import KeepWarm, keep_warm

__all__ = [
    "UNSUPPORTED",
    "KeepWarm",
    "ReplayError",
    "RouteRecorder",
    "RouteReplayer",
    "RouterSite",
    "UnsupportedGenerationError",
    "UnsupportedModelError",
    "find_routers",
    "keep_warm",
    "open_contexts",
    "record_routes",
    "replay_routes",
]
