"""Type checks of settings against their annotations, shared by the `TrainConfig` checks (config_check.py) and the
`[policy]` table's (policy_check.py): a bool is not a number, an int is taken for a float, a float never for an int,
a string never for a number; unknown names get the nearest valid one."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any

PATH_FIELDS = ("output", "init")  # str settings that also take an os.PathLike (stored as str)


def check_types(cfg: Any) -> None:
    """Check each field of the dataclass instance `cfg` against its annotation (int, float, bool, str, dict, or one
    of them | None): a bool is not a number, an int is taken for a float (converted), a float is never taken for an
    int (not even 3.0: a computed count would be truncated unsaid), and a string is never taken for a number or a
    bool. Converts in place; raises ValueError naming the field, the value and the type expected.

    Example:
        >>> check_types(TrainConfig(steps=50.0))  # doctest: +SKIP
        ValueError: steps must be an int, got 50.0 (a float): write 50
    """
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in PATH_FIELDS and isinstance(value, os.PathLike):
            value = os.fspath(value)
        setattr(cfg, f.name, typed(f.name, value, hints[f.name]))


def typed(name: str, value: Any, hint: Any) -> Any:
    """`value` as the annotation `hint` wants it (int -> float), or ValueError naming `name`, the value and the type.

    Example:
        >>> typed("lr", 1, float)
        1.0
    """
    options = (
        typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else ()
    )
    if options:
        if value is None and type(None) in options:
            return None
        (hint,) = [o for o in options if o is not type(None)]
    kind = typing.get_origin(hint) or hint
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    if kind not in (bool, int, float, str, dict) and isinstance(kind, type) and isinstance(value, kind):
        return value
    if kind is dict and isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{name} keys must be strings, got {bad[0]!r} in {dict(value)!r}")
        return dict(value)
    names = {bool: "a bool", int: "an int", float: "a number", str: "a string", dict: "a table (a dict)"}
    expected = names.get(kind, getattr(kind, "__name__", str(kind)))
    if options:
        expected += " or None"
    hint_text = ""
    if isinstance(value, str) and kind in (int, float, bool):
        hint_text = ": write it without quotes"
    elif kind is int and isinstance(value, float):
        hint_text = f": write {int(value)}" if value.is_integer() else ": a count must be a whole number"
    got = type(value).__name__
    raise ValueError(
        f"{name} must be {expected}, got {value!r} ({'an' if got[0] in 'aeiou' else 'a'} {got}){hint_text}"
    )


def simple(hint: Any) -> bool:
    """Whether `typed` checks `hint`: int, float, bool or str, or one of them | None (not a string annotation).

    Example:
        >>> simple(int | None), simple(list)
        (True, False)
    """
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [o for o in options if o is not type(None)]
    return len(kinds) == 1 and kinds[0] in (bool, int, float, str)


def nearest(word: object, names: Collection[str]) -> str:
    """': did you mean X?' for the valid name nearest `word`, or ''.

    Example:
        >>> nearest("num_expert", ["num_experts", "top_k"])
        ": did you mean 'num_experts'?"
    """
    if not isinstance(word, str):
        return ""
    match = difflib.get_close_matches(word, list(names), n=1)
    return f": did you mean {match[0]!r}?" if match else ""
