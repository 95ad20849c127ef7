"""Record and replay router choices on Hugging Face transformers MoE models."""

from .discover import UNSUPPORTED, RouterSite, UnsupportedModelError, find_routers
from .generation import UnsupportedGenerationError
from .hub import ReplayError
from .record import RouteRecorder, record_routes
from .replay import RouteReplayer, replay_routes

__all__ = [
    "UNSUPPORTED",
    "ReplayError",
    "RouteRecorder",
    "RouteReplayer",
    "RouterSite",
    "UnsupportedGenerationError",
    "UnsupportedModelError",
    "find_routers",
    "record_routes",
    "replay_routes",
]
