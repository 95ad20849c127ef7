"""Record and replay router choices on Hugging Face transformers MoE models: what a user calls.

Layout (docs/design.md walks one router call through it): `discover` finds the routers; `hub` holds the hooks of one
model (`patch`), and its routers' `wrapper` runs each router call (`call`), whose experts are picked by the router's
`selectors` (`sparsemixer` for PhiMoE); `facts` keeps what was learned about each router, `warm` keeps it across
contexts in a `keep_warm` scope; `steps` and `generation` place each forward's tokens; `record` and `replay` are the
contexts.
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
