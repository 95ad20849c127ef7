"""moe-replay: Routing Replay for reinforcement learning on Mixture-of-Experts language models.

Example:
    >>> from moe_replay import record_routes, replay_routes, Routes
    >>> with record_routes(model) as rec:  # doctest: +SKIP
    ...     out = model.generate(**batch, do_sample=True, return_dict_in_generate=True)
    >>> with replay_routes(model, rec.routes):  # doctest: +SKIP
    ...     logits = model(out.sequences).logits
"""

from . import deprecation
from .analysis import ExpertChange, expert_change, measure_mismatch, measure_update_drift, teacher_forced_routes
from .engines import record_routes, replay_routes
from .engines.hf import find_routers, keep_warm
from .errors import (
    ForeignThreadError,
    NestedContextError,
    ReplayError,
    RoutesFileError,
    UnsupportedGenerationError,
    UnsupportedModelError,
)
from .routes import LayerInfo, Packed, PackedRoutes, Routes, Segment, assemble_routes, fresh, from_packed, to_packed

__version__ = "0.1.0"

__all__ = [
    "ExpertChange",
    "ForeignThreadError",
    "LayerInfo",
    "NestedContextError",
    "Packed",
    "PackedRoutes",
    "ReplayError",
    "Routes",
    "RoutesFileError",
    "Segment",
    "UnsupportedGenerationError",
    "UnsupportedModelError",
    "__version__",
    "assemble_routes",
    "expert_change",
    "find_routers",
    "fresh",
    "from_packed",
    "keep_warm",
    "measure_mismatch",
    "measure_update_drift",
    "record_routes",
    "replay_routes",
    "teacher_forced_routes",
    "to_packed",
]

# deprecated names, one release: each read warns and names its new place
__getattr__ = deprecation.moved(
    __name__,
    renamed={
        "pack_routes": "moe_replay.routes.packed.to_packed",
        "unpack_routes": "moe_replay.routes.packed.from_packed",
    },
)
