"""No host-device synchronisation per router call: a spy counts the tensor operations that read device data on the
host (`item`, `tolist`, `bool`, `nonzero`, `.cpu()`, ...) during plain, recorded and replayed forwards; moe-replay
may add none per router call (on CPU the spy is a proxy for what a GPU would wait on)."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from families import build_tiny_model
from torch.overrides import TorchFunctionMode

from moe_replay import ReplayError, Routes, record_routes, replay_routes

T = torch.Tensor
HOST_READS = frozenset(
    {T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.nonzero, torch.nonzero, T.cpu, T.numpy}
    | {torch.equal, torch.allclose, T.any, T.all}  # `any`/`all` only when their result is read: counted as callers
)


class HostReads(TorchFunctionMode):
    """Counts host-reading tensor operations by who issued them: the moe-replay function, when the innermost frame
    outside torch is moe-replay's, else "model"."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in HOST_READS and func not in (T.any, T.all):
            caller = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
            ours = "/moe_replay/" in caller.filename
            self.seen[f"{caller.name} ({func.__name__})" if ours else "model"] += 1
        return func(*args, **(kwargs or {}))


def reads(run) -> collections.Counter[str]:  # noqa: ANN001
    """Host reads of `run()`, after one unspied run (a context's first forward may check its routes once)."""
    run()
    with HostReads() as spy:
        run()
    return spy.seen


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "phimoe"])
@pytest.mark.parametrize("track_live", [False, True])
def test_no_host_reads_per_router_call(family, track_live):
    model = build_tiny_model(family)
    ids = torch.randint(5, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding: unrecorded positions route live
    with torch.no_grad():
        forward = lambda: model(ids, attention_mask=mask)  # noqa: E731
        with record_routes(model) as rec:
            forward()
        plain = reads(forward)
        with record_routes(model):
            recorded = reads(forward)
        with replay_routes(model, rec.routes, track_live=track_live):
            replayed = reads(forward)
    assert recorded == plain, f"recording added host reads: {recorded - plain}"
    assert replayed == plain, f"replay added host reads: {replayed - plain}"


def test_group_limited_replay_still_refuses_routes_outside_the_kept_groups():
    model = build_tiny_model("deepseek_v3", top_k=3)  # 8 experts in 4 groups of 2, topk_group=2
    ids = torch.randint(5, 100, (1, 6))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    routes = rec.routes
    indices = routes.indices.clone()
    indices[0, 4, 1] = torch.tensor([0, 2, 4], dtype=indices.dtype)  # groups 0, 1 and 2 for one token
    with pytest.raises(ReplayError, match="keeps topk_group=2 of 4 expert groups, but the routes use 3 groups"):
        with torch.no_grad(), replay_routes(model, Routes(indices, routes.mask, routes.layers)):
            model(ids)


def test_no_host_reads_while_recording_generate():
    model = build_tiny_model("qwen3_moe")
    ids = torch.randint(5, 100, (2, 6))
    with torch.no_grad():
        run = lambda: model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)  # noqa: E731
        plain = reads(run)
        with record_routes(model):
            recorded = reads(run)
    extra = recorded - plain
    assert not extra, f"recording under generate added host reads: {extra}"
