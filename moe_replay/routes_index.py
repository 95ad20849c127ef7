"""Deprecated: moved to `moe_replay.routes.index`. Importing this module does not warn; reading a name here warns
(DeprecationWarning) and gives that module's object. Removed in the next release.

Example:
    >>> from moe_replay.routes.index import *  # doctest: +SKIP
"""

from .deprecation import moved

__getattr__ = moved(__name__, "moe_replay.routes.index")
