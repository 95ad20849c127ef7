"""Deprecated: moved to `moe_replay.routes.packed`. Importing this module does not warn; reading a name here warns
(DeprecationWarning) and gives that module's object. Removed in the next release.

Example:
    >>> from moe_replay.routes.packed import *  # doctest: +SKIP
"""

from .deprecation import moved

__getattr__ = moved(
    __name__,
    "moe_replay.routes.packed",
    renamed={
        "pack_routes": "moe_replay.routes.packed.to_packed",
        "unpack_routes": "moe_replay.routes.packed.from_packed",
    },
)
