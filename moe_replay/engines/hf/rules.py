"""Which selectors (selectors.py, sparsemixer.py) a router's calls are offered, in order, and the check of their
declared contract: the first selector that claims a torch function runs it, so one that claims every call of its
functions (`catch_all`) must come last.
"""

from __future__ import annotations

from torch import nn

from .selectors import GroupTopK, Selector, TopK
from .sparsemixer import ROUTER_CLASSES, SparsemixerPicks


def check_rules(rules: tuple[type[Selector], ...]) -> tuple[type[Selector], ...]:
    """`rules`, if they keep `Selector`'s contract: selector classes with the functions they claim, at most one
    `catch_all`, offered last. Raises `TypeError` naming the selector that breaks it.

    Example:
        >>> check_rules((GroupTopK, TopK)) == (GroupTopK, TopK)
        True
    """
    for n, rule in enumerate(rules):
        if not (isinstance(rule, type) and issubclass(rule, Selector)) or not rule.funcs:
            raise TypeError(f"{rule!r} is not a Selector subclass that claims some torch functions (`funcs`)")
        if rule.catch_all and n != len(rules) - 1:
            raise TypeError(
                f"{rule.__name__} claims every call of its functions (catch_all) but is offered before "
                f"{', '.join(r.__name__ for r in rules[n + 1 :])}, which would never see one"
            )
    return rules


def selectors_for(router: nn.Module) -> tuple[type[Selector], ...]:
    """The selectors of a router, in the order they are offered each intercepted call.

    Example:
        >>> selectors_for(model.model.layers[0].mlp.gate)  # doctest: +SKIP
        (GroupTopK, TopK)
    """
    if type(router).__name__ in ROUTER_CLASSES:
        return check_rules((SparsemixerPicks,))
    return check_rules((GroupTopK, TopK))
