"""Names that moved: a module's `__getattr__` that forwards each old name to its new place with a DeprecationWarning.

Importing a module that kept only old names does not warn; reading one of them does (once per place that reads it,
by Python's default filters), naming the new place. Each old name works for one release.

Example:
    >>> __getattr__ = moved("moe_replay.routes_io", "moe_replay.routes.io")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

_MISSING = object()


def moved(old: str, default: str | None = None, renamed: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """A module-level `__getattr__` for module `old`: a name of `renamed` ({old name: "new.module.new_name"}) or, when
    `default` (a module path) is given, any public name of that module, read at `old`, warns (DeprecationWarning
    "old.name is deprecated: use new.module.name") and is the object at its new place; any other name raises
    AttributeError, as a module without it would.

    Example:
        >>> getattr_ = moved("pkg.old", renamed={"rows_to_routes": "moe_replay.routes.rows.from_rows"})
        >>> import warnings; warnings.simplefilter("ignore")
        >>> getattr_("rows_to_routes").__name__
        'from_rows'
    """
    renamed = dict(renamed or {})

    def __getattr__(name: str) -> Any:
        if name in renamed:
            module, _, new = renamed[name].rpartition(".")
        elif default is not None and not name.startswith("_"):
            module, new = default, name
        else:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), new, _MISSING)
        if value is _MISSING:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old}.{name} is deprecated: use {module}.{new}", DeprecationWarning, stacklevel=2)
        return value

    return __getattr__
