"""Record and replay router choices on Hugging Face transformers MoE models.

Layout: `discover` finds the routers; `hub` holds the hooks of one model (`patch`), and its routers' `wrapper` runs
each router call (`call`), whose experts are picked by the router's `selectors` (`sparsemixer` for PhiMoE); `facts`
keeps what was learned about router classes; `steps` and `generation` place each forward's tokens; `record` and
`replay` are the contexts.
"""

from ...errors import ReplayError, UnsupportedGenerationError, UnsupportedModelError
from .discover import UNSUPPORTED, RouterSite, find_routers
from .facts import RouterFacts, router_facts
from .record import RouteRecorder, record_routes
from .replay import RouteReplayer, replay_routes
from .selectors import GroupTopK, Selector, TopK, selectors_for
from .sparsemixer import SparsemixerPicks

__all__ = [
    "UNSUPPORTED",
    "GroupTopK",
    "ReplayError",
    "RouteRecorder",
    "RouteReplayer",
    "RouterFacts",
    "RouterSite",
    "Selector",
    "SparsemixerPicks",
    "TopK",
    "UnsupportedGenerationError",
    "UnsupportedModelError",
    "find_routers",
    "record_routes",
    "replay_routes",
    "router_facts",
    "selectors_for",
]
