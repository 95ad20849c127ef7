"""`moe-replay demo`: a two-minute tour: build a tiny MoE, record routes while sampling, update the weights, replay.

Example:
    $ moe-replay demo --seed 1
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from .. import tiny
from ..analysis import expert_change
from ..engines import record_routes, replay_routes
from ..routes import Routes


def tiny_moe(seed: int = 0, *, layers: int = 4, experts: int = 16, top_k: int = 2) -> nn.Module:
    """A tiny Qwen3-MoE causal LM built from a transformers config (random weights, about 0.4M parameters, router
    weights drawn with std 0.5 so that top-k choices are not near ties): `moe_replay.tiny.tiny_moe` with the demo's
    settings.

    Example:
        >>> model = tiny_moe()  # doctest: +SKIP
    """
    return tiny.tiny_moe(
        seed, layers=layers, experts=experts, top_k=top_k, router_std=0.5, bos_token_id=1, eos_token_id=2
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the `demo` subcommand."""
    demo = sub.add_parser("demo", help="record routes while sampling from a tiny MoE, update it, replay them")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--lr", type=float, default=1e-4, help="learning rate of the one Adam step (default 1e-4)")


def _changed(a: Routes, b: Routes) -> float:
    """Share of recorded (token, layer) pairs whose expert set differs."""
    return expert_change(a, b).set_changed


def run(seed: int = 0, lr: float = 1e-4) -> dict[str, float]:
    """Record while sampling, take one optimizer step, and compare live routing with replay; print and return figures.

    Example:
        >>> figures = run()  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    model = tiny_moe(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 64, (8, 12), generator=g)
    mask = torch.ones_like(prompts)
    mask[::2, :4] = 0  # left padding on every other row
    prompts[mask == 0] = 0
    sampling = {"do_sample": True, "max_new_tokens": 16, "min_new_tokens": 16, "return_dict_in_generate": True}
    torch.manual_seed(seed)
    with record_routes(model) as rec:
        out = model.generate(input_ids=prompts, attention_mask=mask, pad_token_id=0, **sampling)
    routes = rec.routes
    seq = out.sequences
    full = torch.cat([mask, mask.new_ones(seq.shape[0], seq.shape[1] - mask.shape[1])], 1)
    print(f"sampled {tuple(seq.shape)} tokens with recording: {routes}")
    print(f"  {routes.nbytes} bytes of routes ({routes.indices.dtype}, {routes.top_k} bytes per token and layer)")

    with record_routes(model) as tf:
        ref = model(seq, attention_mask=full).logits
    print(f"teacher-forced forward picks the same experts as sampling: {_changed(routes, tf.routes) == 0.0}")
    with replay_routes(model, routes):
        same = torch.equal(model(seq, attention_mask=full).logits, ref)
    print(f"replaying the recorded routes gives bit-identical logits: {same}")

    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model(seq, attention_mask=full, labels=seq.masked_fill(full == 0, -100)).loss.backward()
    opt.step()
    model.eval()
    with record_routes(model) as live:
        model(seq, attention_mask=full)
    with replay_routes(model, routes), record_routes(model) as forced:
        model(seq, attention_mask=full)
    figures = {
        "changed_without_replay": _changed(routes, live.routes),
        "changed_with_replay": _changed(routes, forced.routes),
        "seconds": time.perf_counter() - t0,
    }
    print(
        f"after one Adam step (lr {lr}): expert sets changed for "
        f"{figures['changed_without_replay']:.1%} of (token, layer) pairs routed live, "
        f"{figures['changed_with_replay']:.1%} under replay"
    )
    print(f"done in {figures['seconds']:.1f} s")
    return figures
