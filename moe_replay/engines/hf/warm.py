"""`keep_warm`, deprecated: contexts learn nothing from one another now, so its scope does nothing."""

from __future__ import annotations

import contextlib
import warnings

from torch import nn

KeepWarm = contextlib.nullcontext  # deprecated: the type `keep_warm` returns


def keep_warm(model: nn.Module) -> contextlib.nullcontext:
    """Deprecated, a no-op that warns `DeprecationWarning`: contexts keep nothing between them (a cold context costs
    about 0.4 ms on a tiny model). Drop the `with keep_warm(model):` around your contexts.

    Example:
        >>> import pytest
        >>> with pytest.warns(DeprecationWarning):
        ...     scope = keep_warm(nn.Linear(2, 2))
    """
    warnings.warn(
        "keep_warm is deprecated and does nothing: record/replay contexts keep nothing between them (a cold context "
        "costs about 0.4 ms on a tiny model); remove the scope. It goes in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    if not isinstance(model, nn.Module):
        raise ValueError(f"keep_warm needs a model (torch.nn.Module), got {type(model).__name__}")
    return contextlib.nullcontext(model)
