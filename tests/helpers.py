"""Helpers shared by the tests: tiny MoE models built from transformers configs (offline, CPU), batches, hook counts."""

from __future__ import annotations

import inspect
import socket
from typing import Any

import torch
from torch import nn

from moe_replay import Routes, record_routes
from moe_replay.tiny import tiny_moe

VOCAB = 64
PAD = 0


def kv(cache: Any) -> dict[str, Any]:
    """A KV cache as the keyword the installed transformers' forwards and generate take: `cache` (5.2x), or
    `past_key_values` (5.19, the floor)."""
    from transformers import Qwen3MoeForCausalLM

    forward = inspect.signature(Qwen3MoeForCausalLM.forward).parameters
    return {"cache" if "cache" in forward else "past_key_values": cache}


def tiny_qwen3_moe(seed: int = 0, *, layers: int = 3, experts: int = 8, top_k: int = 2) -> nn.Module:
    """A 3-layer Qwen3-MoE (layer 1 dense) with well-separated router scores."""
    shape = {"layers": layers, "experts": experts, "top_k": top_k, "dense_layers": [1] if layers > 2 else []}
    return tiny_moe(seed, **shape, vocab=VOCAB, router_std=0.5, intermediate_size=96, pad_token_id=PAD)


def own_choice_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Qwen3-MoE block's forward that picks its experts itself: the top-k of the negated router logits."""
    batch, length, width = hidden_states.shape
    flat = hidden_states.view(-1, width)
    logits, _, _ = self.gate(flat)
    weights, experts = torch.topk(-logits, self.gate.top_k, dim=-1)
    return self.experts(flat, experts, weights.softmax(-1)).reshape(batch, length, width)


def left_padded(batch: int, length: int, pads: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] and attention_mask [B, T] with pads[b] left-padding positions in row b."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, p in enumerate(pads):
        ids[b, :p] = PAD
        mask[b, :p] = 0
    return ids, mask


def extend_mask(mask: torch.Tensor, total: int) -> torch.Tensor:
    """The attention mask of a prompt, extended with ones over the generated positions."""
    return torch.cat([mask, mask.new_ones(mask.shape[0], total - mask.shape[1])], dim=1)


def hook_count(model: nn.Module) -> int:
    """Forward hooks, pre-hooks and patched forward/generate methods anywhere in the model."""
    n = "generate" in model.__dict__
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + ("forward" in m.__dict__)
    return n


def recorded(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Routes:
    """The routes of one plain forward of `model` over `ids` [B, T] with `mask` [B, T]."""
    with record_routes(model) as rec:
        model(ids, attention_mask=mask)
    return rec.routes


def experts_used(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, context: Any) -> torch.Tensor:
    """The experts each MoE layer's experts module was given in one no-grad forward of a Qwen3-MoE under `context`
    (a record or replay context, or a nullcontext), sorted, [B, T, L, K]."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    got = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: got.append(args[1].clone()))
        for m in model.modules()
        if isinstance(m, Qwen3MoeExperts)
    ]
    try:
        with torch.no_grad(), context:
            model(ids, attention_mask=mask)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([g.reshape(*ids.shape, -1) for g in got], 2).sort(-1).values


def perturb(model: nn.Module, scale: float = 0.3, seed: int = 5, min_std: float = 1e-3) -> None:
    """Add noise (scale x each weight's sd, at least `min_std`) to every floating-point weight of `model`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point and p.numel() > 1:
                noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)  # (drawn on the CPU: the same anywhere)
                p.add_(noise * scale * p.float().std().clamp(min=min_std))


def sampled(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int, *, exact: bool = True, **kwargs: Any
) -> tuple[Any, Routes]:
    """(`generate`'s output, the routes recorded while it sampled `new` tokens; `exact`: no fewer either).

    Other `generate` arguments pass through (pad_token_id defaults to PAD)."""
    kwargs = {"pad_token_id": PAD, "do_sample": True, "return_dict_in_generate": True, **kwargs}
    if exact:
        kwargs["min_new_tokens"] = new
    with record_routes(model) as rec:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **kwargs)
    return out, rec.routes


class Delegating(nn.Module):
    """A wrapper module whose generate calls its model's with `extra` keyword arguments added."""

    def __init__(self, model: nn.Module, **extra) -> None:  # noqa: ANN003
        super().__init__()
        self.pretrained_model, self.extra = model, extra

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self.pretrained_model(*args, **kwargs)

    def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self.pretrained_model.generate(*args, **kwargs, **self.extra)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a gloo rendezvous (a fixed port collides when two test runs share the
    machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


MARGIN = 1e-3  # router logits closer than this at the top-k boundary are a near-tie (see near_ties)


def near_ties(router_logits: tuple[torch.Tensor, ...], top_k: int, shape: tuple[int, int]) -> torch.Tensor:
    """bool [B, T, L]: where a forward's router logits (one [B·T, E] per MoE layer, `output_router_logits=True`) put
    the k-th and the (k+1)-th expert within `MARGIN` of each other. Generate's KV-cached decode and a full forward
    compute the same router logits up to float noise of ~1e-6 (fp32, logits of order 1; under bf16 autocast, as TRL's
    default runs, whole bf16 steps of ~0.02), which can swap the experts of a near-tie and of nothing else; which pairs
    are near-ties depends on the CPU's vector units and library versions, so comparisons of routes from two such
    forwards leave them out instead of allowing a share of disagreement.

    Example:
        >>> out = model(ids, attention_mask=mask, output_router_logits=True)  # doctest: +SKIP
        >>> ties = near_ties(out.router_logits, 2, ids.shape)  # doctest: +SKIP
    """
    B, T = shape
    gaps = []
    for scores in router_logits:
        top = scores.float().topk(top_k + 1, dim=-1).values
        gaps.append((top[:, top_k - 1] - top[:, top_k]).reshape(B, T))
    return torch.stack(gaps, -1) < MARGIN


def differ(a: Routes, b: Routes) -> torch.Tensor:
    """bool [B, T, L]: where `a` and `b` both recorded the position and hold other expert sets."""
    both = (a.mask & b.mask)[..., None]
    return both & (a.indices.long().sort(-1).values != b.indices.long().sort(-1).values).any(-1)


def kept_pairs(differing: torch.Tensor, ties: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """bool [B, T, L]: the `recorded` [B, T] pairs that are neither a near-tie of the reference forward (`ties`
    [B, T, L]) nor downstream of a near-tie at which the two forwards came out otherwise (`differing` [B, T, L]): a
    later MoE layer at the same or a later position of its row, whose hidden states were computed from other experts.
    Unless float noise swapped a near-tie, every recorded pair but the near-ties."""
    layers = torch.arange(ties.shape[-1], device=ties.device)
    swapped = torch.where(differing & ties, layers, ties.shape[-1]).amin(-1).cummin(1).values  # [B, T]
    return recorded[..., None] & ~ties & (layers <= swapped[..., None])


def compared_pairs(a: Routes, b: Routes, ties: torch.Tensor) -> torch.Tensor:
    """bool [B, T, L]: the pairs two forwards' routes `a` and `b` must agree at (`kept_pairs`), `ties` those of the
    reference forward (`near_ties`)."""
    return kept_pairs(differ(a, b), ties, a.mask & b.mask)


def same_but_near_ties(a: Routes, b: Routes, ties: torch.Tensor) -> torch.Tensor:
    """Assert that `a` and `b` hold the same expert sets at every pair `compared_pairs` keeps, and that it keeps one;
    return those pairs, bool [B, T, L]."""
    compared = compared_pairs(a, b, ties)
    assert compared.any(), "no (token, layer) pair left to compare"
    assert not differ(a, b)[compared].any(), f"{int(differ(a, b)[compared].sum())} pairs differ outside near-ties"
    return compared
