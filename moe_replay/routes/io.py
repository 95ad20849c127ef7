"""`Routes` files: safetensors holding `indices`, `mask` and, if the routes have them, their per-position policy
`version`s, with a JSON header (format, format version, layers). Format 1 (no versions) still loads.

Example:
    >>> routes.save("r.safetensors"); Routes.load("r.safetensors", validate=False)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch

from ..errors import RoutesFileError
from .check import check_version
from .core import Routes, check_structure
from .layers import LayerInfo, index_dtype

FORMAT_NAME = "moe-replay.routes"
FORMAT_VERSION = 2  # 2: an optional `version` tensor
READS = ("1", "2")


def save_routes(routes: Routes, path: str | os.PathLike) -> None:
    """Write `routes` to `path` (what `Routes.save` does)."""
    from safetensors.torch import save_file

    meta = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "layers": json.dumps([asdict(layer) for layer in routes.layers]),
    }
    tensors = {"indices": routes.indices.contiguous().cpu(), "mask": routes.mask.contiguous().cpu()}
    if routes.version is not None:
        tensors["version"] = routes.version.contiguous().cpu()
    save_file(tensors, os.fspath(path), metadata=meta)


def load_routes(
    cls: type[Routes], path: str | os.PathLike, device: torch.device | str = "cpu", *, validate: bool = True
) -> Routes:
    """Read `path` (what `Routes.load` does). Shapes, dtypes and layers are always checked; `validate=False` skips
    only the per-id checks, and only when the ids are stored in the dtype `save` writes (narrowing unchecked ids
    could wrap one out of range, e.g. 300, into a valid-looking one, 44)."""
    from safetensors import safe_open

    path = os.fspath(path)
    try:
        with safe_open(path, framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            if meta.get("format") != FORMAT_NAME:
                raise RoutesFileError(
                    f"{path} is not a moe-replay routes file: header format is {meta.get('format')!r}, "
                    f"expected {FORMAT_NAME!r}"
                )
            if meta.get("version") not in READS:
                raise RoutesFileError(
                    f"{path} has routes format version {meta.get('version')!r}; this moe-replay reads "
                    f"versions {', '.join(READS)}"
                )
            allowed = ({"indices", "mask"}, {"indices", "mask", "version"})
            if keys not in allowed[: 1 + (meta["version"] != "1")]:
                raise RoutesFileError(
                    f"{path} holds tensors {sorted(keys)}, expected ['indices', 'mask'] (and 'version' from format 2)"
                )
            indices, mask = f.get_tensor("indices"), f.get_tensor("mask")
            version = f.get_tensor("version") if "version" in keys else None
    except (RoutesFileError, FileNotFoundError):
        raise
    except Exception as e:  # safetensors raises its own error types for truncated or malformed files
        raise RoutesFileError(f"{path} could not be read as a safetensors routes file: {e}") from e
    try:
        layers = check_structure(indices, mask, [LayerInfo(**d) for d in json.loads(meta["layers"])])
        if validate or indices.dtype != index_dtype(max((layer.num_experts for layer in layers), default=1)):
            return cls(indices, mask, layers, version)
        return cls._trusted(indices, mask, layers, check_version(version, mask))
    except (ValueError, TypeError, KeyError) as e:
        raise RoutesFileError(f"{path}: inconsistent routes file: {e}") from e
