"""`replay_routes(model, packed)`: a packed row's routes (`pack_routes`), replayed only on a forward that runs the row
as packed sequences, so that no sequence's tokens attend to another's.

Hugging Face transformers (5.x) treats a row as packed sequences only when the forward gets `position_ids` that
restart per sequence, no attention mask and no KV cache (`masking_utils.find_packed_sequence_indices`); with the
default `use_cache` (a cache made for the forward) or any attention mask the sequences silently attend to each other,
and the replayed routes then belong to another computation. megatron-core runs a packed row through
`PackedSeqParams(qkv_format="thd")`. Each forward is checked before it runs, naming what is wrong.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..errors import ReplayError
from ..routes_packed import Packed


class PackedReplayer:
    """Context manager returned by `replay_routes(model, packed)`: the replay of `packed.routes` (attributes such as
    `live_moved` are the inner replay's), with each forward of `model` checked to run the row as packed sequences."""

    def __init__(self, model: nn.Module, packed: Packed, inner: Any, megatron: bool) -> None:
        self.model, self.packed, self.inner, self.megatron = model, packed, inner, megatron
        self._starts = packed.cu_seqlens_padded.tolist()
        self._handle = None

    def __enter__(self) -> PackedReplayer:
        check = self._check_megatron if self.megatron else self._check_transformers
        self._handle = self.model.register_forward_pre_hook(lambda m, a, k: check(a, k), with_kwargs=True)
        try:
            self.inner.__enter__()
        except BaseException:
            self._handle.remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> Any:
        self._handle.remove()
        return self.inner.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _check_transformers(self, args: tuple, kwargs: dict[str, Any]) -> None:
        bound = inspect.signature(self.model.forward).bind_partial(*args, **kwargs).arguments
        why = None
        if bound.get("attention_mask") is not None:
            why = "it was given an attention_mask (pass attention_mask=None)"
        elif bound.get("past_key_values") is not None:
            why = "it was given a KV cache"
        elif bound.get("use_cache") is not False and getattr(self.model.config, "use_cache", False):
            why = "it makes a KV cache (use_cache defaults to True in the model's config: pass use_cache=False)"
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
        found = position_ids.reshape(-1)
        N = self.packed.routes.seq_len
        starts = self._starts
        expected = torch.cat([torch.arange(b - a) for a, b in zip(starts[:-1], starts[1:], strict=True)])
        expected = torch.cat([expected, torch.arange(N - starts[-1])]) if N > starts[-1] else expected
        if found.numel() != N:
            raise ReplayError(f"the forward has {found.numel()} position_ids but the packed routes {N} positions")
        wrong = (found.cpu() != expected).nonzero()
        if wrong.numel():
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
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if cu.reshape(-1).tolist() != self._starts:
            raise ReplayError(
                f"the forward's PackedSeqParams have cu_seqlens {cu.reshape(-1).tolist()} but the packed routes' "
                f"sequences start at {self._starts}"
            )
