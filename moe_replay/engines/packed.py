"""`replay_routes(model, packed)`: a packed row's routes (`to_packed`), replayed only on a forward that runs the row
as packed sequences, so that no sequence's tokens attend to another's.

transformers (5.x) runs a row as packed sequences only given `position_ids` that restart per sequence, no attention
mask and no KV cache (`masking_utils.find_packed_sequence_indices`); else (`use_cache`'s default included) they
silently attend to each other, and the replayed routes belong to another computation. Families whose layers carry
state along the row (state-space, linear or compressed attention) or build masks without `position_ids` mix them even
then: only the families verified for the installed release (`packed_families()`, each checked against its padded
forward by the family test) are accepted. Each outermost forward of a tracked model (the model given, or an inner
transformers model holding all its routers, such as `model.model`) is checked before it runs; a megatron-core one
must run the row through `PackedSeqParams(qkv_format="thd")`, checked on the model given."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..errors import ReplayError
from ..routes.packed import PackedRoutes
from .hf.tracker import bind
from .packed_families import VERIFIED, packed_families

CACHES = ("cache", "past_key_values", "cache_params")  # what transformers' forwards call a KV (or state) cache


class PackedReplayer:
    """Context manager returned by `replay_routes(model, packed_routes)`: the inner replay (`live_moved` and its other
    attributes), with each forward of `model` checked to run the row as those packed sequences."""

    def __init__(self, model: nn.Module, routes: PackedRoutes, inner: Any, megatron: bool) -> None:
        self.model, self.routes, self.inner, self.megatron = model, routes, inner, megatron
        self._starts, self._handle = list(routes.cu_seqlens_padded), None

    def __enter__(self) -> PackedReplayer:
        if self.megatron:
            check = self._check_megatron
            self._handle = self.model.register_forward_pre_hook(lambda m, a, k: check(a, k), with_kwargs=True)
        else:
            self._check_family()
        try:
            self.inner.__enter__()
        except BaseException:
            if self._handle is not None:
                self._handle.remove()
            raise
        if not self.megatron:  # (every outermost forward of a tracked model, checked before it runs: hf/steps.py)
            self.inner.forward_check = self._check_transformers
        return self

    def __exit__(self, *exc: Any) -> Any:
        if self._handle is not None:
            self._handle.remove()
        else:
            self.inner.forward_check = None
        return self.inner.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _check_family(self) -> None:
        import transformers

        family, accepted = getattr(getattr(self.model, "config", None), "model_type", None), packed_families()
        if not accepted:
            raise ReplayError(
                f"packed routes replayed under transformers {transformers.__version__}, a release whose families "
                f"moe-replay has not verified to run a packed row's sequences apart (verified: {sorted(VERIFIED)}); "
                "replay the padded batch's routes on the padded batch instead"
            )
        if family not in accepted:
            raise ReplayError(
                f"packed routes replayed on a {family!r} model ({type(self.model).__name__}): moe-replay accepts "
                "packed rows only on the families verified to run a packed row's sequences apart under transformers "
                f"{transformers.__version__} ({', '.join(sorted(accepted))}); in others, layers that carry state "
                "along the row or masks built without position_ids let the sequences see each other. Replay the "
                "padded batch's routes on the padded batch instead"
            )

    def _check_transformers(self, forward: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        bound = bound_arguments(forward, args, kwargs)
        module = getattr(forward, "__self__", None)  # (the tracked model whose forward this is; else the one given)
        config = getattr(module if isinstance(module, nn.Module) else self.model, "config", None)
        use_cache, why = bound.get("use_cache"), None
        if bound.get("attention_mask") is not None:
            why = "it was given an attention_mask (pass attention_mask=None)"
        elif any(bound.get(name) is not None for name in CACHES):
            why = "it was given a KV cache"
        elif use_cache is True or (use_cache is None and getattr(config, "use_cache", False)):
            why = "it makes a KV cache (use_cache is on, by argument or in the model's config: pass use_cache=False)"
        elif bound.get("position_ids") is None:
            why = "it was given no position_ids (pass ones that restart at 0 for every sequence)"
        if why is not None:
            raise ReplayError(
                f"packed routes replayed on a forward that transformers does not run as packed sequences: {why}; "
                "transformers separates packed sequences only when position_ids restart per sequence and there is no "
                "attention mask and no cache, otherwise the sequences attend to each other"
            )
        self._check_positions(bound["position_ids"])

    def _check_positions(self, position_ids: torch.Tensor) -> None:
        """position_ids must restart exactly where the packed sequences start."""
        found, N, starts = position_ids.reshape(-1), self.routes.seq_len, self._starts
        expected = torch.cat([torch.arange(b - a) for a, b in zip(starts[:-1], starts[1:], strict=True)])
        expected = torch.cat([expected, torch.arange(N - starts[-1])]) if N > starts[-1] else expected
        if found.numel() != N:
            raise ReplayError(f"the forward has {found.numel()} position_ids but the packed routes {N} positions")
        if (wrong := (found.cpu() != expected).nonzero()).numel():
            t = int(wrong[0])
            raise ReplayError(
                f"the forward's position_ids do not restart where the packed routes' sequences start "
                f"(cu_seqlens_padded {starts}): position {t} is {int(found[t])}, expected {int(expected[t])}"
            )

    def _check_megatron(self, args: tuple, kwargs: dict[str, Any]) -> None:
        from megatron.core.packed_seq_params import PackedSeqParams

        params = next((x for x in (*args, *kwargs.values()) if isinstance(x, PackedSeqParams)), None)
        if params is None or params.qkv_format != "thd":
            raise ReplayError(
                "packed routes replayed on a megatron-core forward without PackedSeqParams(qkv_format='thd'): the "
                "row would run as one sequence"
            )
        for side in ("q", "kv"):
            cu = getattr(params, f"cu_seqlens_{side}_padded")
            cu = cu if cu is not None else getattr(params, f"cu_seqlens_{side}")
            if (found := None if cu is None else cu.reshape(-1).tolist()) != self._starts:
                raise ReplayError(
                    f"the forward's PackedSeqParams have cu_seqlens_{side} {found} but the packed routes' sequences "
                    f"start at {self._starts}"
                )


def bound_arguments(forward: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by parameter name, a `**kwargs` parameter's flattened among them (a wrapper's keywords)."""
    return bind(inspect.signature(forward), args, kwargs)
