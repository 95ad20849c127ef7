"""`keep_warm`, deprecated: it kept what contexts learned about a model between them; the engine now learns nothing
(a context's walk of the model costs about a millisecond), so the scope does nothing. Removed in the next release."""

from __future__ import annotations

import warnings

from torch import nn


class KeepWarm:
    """The context manager `keep_warm` returns: it does nothing."""

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"keep_warm needs a model (torch.nn.Module), got {type(model).__name__}")
        self.model = model

    def __enter__(self) -> KeepWarm:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def keep_warm(model: nn.Module) -> KeepWarm:
    """Deprecated, a no-op that warns `DeprecationWarning`: contexts keep nothing between them, and a cold one costs
    about a millisecond. Drop the `with keep_warm(model):` around your contexts.

    Example:
        >>> import pytest
        >>> with pytest.warns(DeprecationWarning):
        ...     scope = keep_warm(nn.Linear(2, 2))
    """
    warnings.warn(
        "keep_warm is deprecated and does nothing: record/replay contexts keep nothing between them (a context's walk "
        "of the model costs about a millisecond); remove the scope. It goes in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return KeepWarm(model)
