"""The pieces of an engine's response the importers read, checked: base64 text, an `.npy` file, nested lists of ids,
token counts. Each refusal is a ValueError whose message starts with `where` (the engine and the response, e.g.
"vLLM output 2, completion 0") and names the field and the offending value as given; nothing is cast, so that
`Routes.from_rows` range-checks the ids in the engine's own dtype.

Shape legend: n positions, C engine columns, K experts per token.
"""

from __future__ import annotations

import binascii
import io
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

INT64_MAX = np.iinfo(np.int64).max


def shown(value: Any) -> str:
    """A value as a message names it: its repr, cut to 40 characters.

    Example:
        >>> shown(None), shown("x" * 50)[-4:]
        ('None', 'x...')
    """
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "..."


def whole(value: Any, where: str, field: str) -> int:
    """`value` as an int >= 0 (an int, numpy integer or whole float; not a bool), or a ValueError naming it.

    Example:
        >>> whole(3, "SGLang response 0", "prompt_tokens"), whole(np.int64(2), "vLLM output 1", "index")
        (3, 2)
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where}: {field} must be a whole number, got {shown(value)}")
    if not isinstance(value, numbers.Integral) and not (math.isfinite(value) and float(value).is_integer()):
        raise ValueError(f"{where}: {field} must be a whole number, got {shown(value)}")
    if value < 0:
        raise ValueError(f"{where}: {field} must not be negative, got {shown(value)}")
    return int(value)


def mapping(value: Any, where: str, field: str) -> Any:
    """`value` if it is a dict (None: an empty one), or a ValueError naming it.

    Example:
        >>> mapping(None, "SGLang response 0", "usage"), mapping({"a": 1}, "SGLang response 0", "usage")
        ({}, {'a': 1})
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: {field} must be a dict, got {shown(value)}")
    return value


def token_count(value: Any, where: str, field: str) -> int:
    """The length of a list of token ids (list, tuple, 1-D array or tensor), or a count given as a whole number.

    Example:
        >>> token_count([5, 6, 7], "vLLM output 0", "token_ids"), token_count(4, "vLLM output 0", "token_ids")
        (3, 4)
    """
    if value is None:
        raise ValueError(f"{where} has no {field}: cannot check the length of its routes")
    if isinstance(value, list | tuple) or isinstance(value, np.ndarray | torch.Tensor) and value.ndim == 1:
        return len(value)
    if isinstance(value, numbers.Real):
        return whole(value, where, field)
    raise ValueError(f"{where}: {field} must be a list of token ids or their count, got {shown(value)}")


def base64_bytes(value: Any, where: str, field: str, *, empty: bool = False) -> bytes:
    """The bytes that base64 text (str or bytes) encodes, strictly: only the base64 alphabet, whole padding; empty
    text refused unless `empty`.

    Example:
        >>> base64_bytes("AQID", "SGLang response 0", "routed_experts")
        b'\\x01\\x02\\x03'
    """
    if isinstance(value, str):
        try:
            value = value.encode("ascii")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where}: {field} is not base64: it holds {value[e.start]!r} at character {e.start}"
            ) from e
    elif not isinstance(value, bytes | bytearray):
        raise ValueError(f"{where}: {field} must be base64 text, got {type(value).__name__} {shown(value)}")
    if not value and not empty:
        raise ValueError(f"{where}: {field} is empty: it holds no routes")
    try:
        return binascii.a2b_base64(value, strict_mode=True)
    except binascii.Error as e:
        raise ValueError(f"{where}: {field} is not base64 ({e}; {len(value)} characters)") from e


def npy_array(raw: bytes, where: str, field: str) -> np.ndarray:
    """The integer array an `.npy` file's bytes hold, read in place (no copy, never a pickle): refused unless the
    header parses, the dtype is an integer one and exactly the data the header describes follows it.

    Example:
        >>> buf = io.BytesIO(); np.save(buf, np.zeros((2, 1, 2), np.uint8))
        >>> npy_array(buf.getvalue(), "vLLM output 0", "routed_experts").shape
        (2, 1, 2)
    """
    fp = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(fp)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f".npy format version {version} is not read here (1.0 and 2.0 are)")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fp)
    except ValueError as e:
        raise ValueError(f"{where}: {field} is not base64 of an .npy file ({len(raw)} bytes: {e})") from e
    if dtype.kind not in "iu":
        raise ValueError(f"{where}: {field} holds {dtype} values: expert ids must be integers")
    if any(s < 0 for s in shape):
        raise ValueError(f"{where}: {field} is an .npy file of shape {shape}")
    count = math.prod(shape)
    have, need = len(raw) - fp.tell(), count * dtype.itemsize
    if have != need:
        raise ValueError(
            f"{where}: {field} is a cut or padded .npy file: its header says {shape} {dtype} ({need} bytes of data) "
            f"but {have} bytes follow"
        )
    array = np.frombuffer(raw, dtype=dtype, count=count, offset=fp.tell())
    return array.reshape(shape[::-1]).T if fortran else array.reshape(shape)


def routes_array(value: Any, where: str, field: str, K: int) -> np.ndarray:
    """Routes [n, C, K] (C >= 1) in the engine's own integer dtype, from a numpy array, a tensor, nested lists, or
    base64 text of an `.npy` file; float, bool and other non-integer values are refused, not cast.

    Example:
        >>> routes_array([[[0, 1]], [[2, 3]]], "vLLM output 0", "routed_experts", K=2).shape
        (2, 1, 2)
    """
    if isinstance(value, str | bytes | bytearray):
        array = npy_array(base64_bytes(value, where, field), where, field)
    elif isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{where}: {field} holds {value.dtype} values: expert ids must be integers")
        array = value.detach().cpu().numpy()
    elif isinstance(value, list | tuple):
        array = _nested(value, where, field)
    else:
        raise ValueError(
            f"{where}: {field} must be an array, nested lists or base64 of an .npy file, got "
            f"{type(value).__name__} {shown(value)}"
        )
    if array.dtype.kind not in "iu":
        first = array.flat[0] if array.size else "none"
        first = shown(first.item() if isinstance(first, np.generic) else first)
        raise ValueError(f"{where}: {field} holds {array.dtype} values (first: {first}): expert ids must be integers")
    if array.ndim != 3 or array.shape[1] < 1:
        raise ValueError(f"{where}: {field} must be [positions, layers, K], got shape {array.shape}")
    if array.shape[2] != K:
        raise ValueError(f"{where}: {field} holds K={array.shape[2]} experts per token but the layers have top_k={K}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and array.size and int(array.max()) > INT64_MAX:
        raise ValueError(f"{where}: {field}: expert id {int(array.max())} does not fit int64")
    return array


def _nested(value: list | tuple, where: str, field: str) -> np.ndarray:
    """Nested lists of ids as an array; ragged lists, nulls and non-integer ids refused, named by their place."""
    try:
        array = np.asarray(value)
    except ValueError:  # ragged: found below
        array = None
    if array is not None and array.dtype.kind in "iu":
        return array
    shape, level = [], value
    while isinstance(level, list | tuple):
        shape.append(len(level))
        level = level[0] if level else None
    found = _misfit(value, shape, ())
    if found is None:  # (no ids at all: an empty list somewhere)
        return np.zeros(shape, dtype=np.int64)
    place, why = found
    raise ValueError(f"{where}: {field}{''.join(f'[{i}]' for i in place)} {why}")


def _misfit(value: Any, shape: list[int], place: tuple) -> tuple[tuple, str] | None:
    """The first place where nested lists leave the `shape` of their first entries, or hold something other than
    an int64 id, and what is wrong there; None if nothing is."""
    if not shape:
        if isinstance(value, list | tuple):
            return place, "is a list where the first entries hold expert ids"
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            return place, f"is {shown(value)}, not an expert id (an integer)"
        return None if -INT64_MAX - 1 <= value <= INT64_MAX else (place, f"is {value}, which does not fit int64")
    if not isinstance(value, list | tuple):
        return place, f"is {shown(value)} where a list of {shape[0]} belongs"
    if len(value) != shape[0]:
        return place, f"holds {len(value)} entries where the first ones hold {shape[0]}"
    for i, item in enumerate(value):
        found = _misfit(item, shape[1:], (*place, i))
        if found is not None:
            return found
    return None
