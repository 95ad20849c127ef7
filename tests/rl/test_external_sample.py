"""`train(..., sample=...)`: an external sampler (an inference engine) samples each step's answers instead of the
loop's own; here a fake one, a bf16 copy of the trainer sampled with transformers, seeded by the step."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest
import torch
from rl_utils import RUN, config

from moe_replay import record_routes
from moe_replay.rl.loop import train
from moe_replay.rl.sampler import make_sampler, sample_with_logp


class FakeEngine:
    """A bf16 copy of the model it is given, sampling under `record_routes` from a generator seeded by the step (the
    global RNG left as it was); remembers what it was called with and what it returned."""

    def __init__(self, routes: bool = True) -> None:
        self.routes = routes
        self.calls: list[dict[str, Any]] = []

    def __call__(self, model: torch.nn.Module, prompts: torch.Tensor, answer_len: int, step: int) -> tuple:
        engine = make_sampler(model, "bfloat16").eval()
        with torch.random.fork_rng():
            torch.manual_seed(1000 + step)
            with record_routes(engine) as rec:
                seq, logp = sample_with_logp(engine, prompts, answer_len)
        routes = rec.routes if self.routes else None
        self.calls.append({"model": model, "prompts": prompts, "step": step, "routes": routes, "seq": seq})
        return seq, logp, routes


def steps_log(out) -> pd.DataFrame:  # noqa: ANN001
    return pd.read_csv(out / "steps.csv").drop(columns=["seconds", "seconds_rollout"])


def test_the_sampler_is_called_every_step_and_its_routes_are_replayed(tmp_path, init):
    engine, seen = FakeEngine(), []

    def observe(model, batch, j, idx):  # noqa: ANN001, ANN202
        seen.append((j, batch))
        return {}

    out = train(config(tmp_path, init, replay="rollout", steps=2), progress=False, observe=observe, sample=engine)
    assert [c["step"] for c in engine.calls] == [0, 1]
    n, g = RUN["prompts"] * RUN["group_size"], RUN["group_size"]
    for call in engine.calls:
        prompts = call["prompts"]
        assert prompts.shape[0] == n and torch.equal(prompts, prompts[::g].repeat_interleave(g, 0))
        assert call["model"] is engine.calls[0]["model"]  # the trainer
    batches = [batch for j, batch in seen if j == 0]
    for call, batch in zip(engine.calls, batches, strict=True):  # the engine's answers and routes, replayed
        assert torch.equal(batch.sequences, call["seq"]) and batch.routes is call["routes"] is batch.train_routes
    log = pd.read_csv(out / "steps.csv")
    assert log["mismatch/fraction"].between(0, 0.5).all() and (log["sampler/kl_k3"] > 0).all()


def test_a_run_with_an_external_sampler_resumes_to_the_same_log(tmp_path, init):
    whole = steps_log(train(config(tmp_path / "a", init, steps=3), progress=False, sample=FakeEngine()))
    killed = config(tmp_path / "b", init, steps=3)
    train(killed, progress=False, stop_after=2, sample=FakeEngine())  # checkpointed at step 2
    resumed = FakeEngine()
    pd.testing.assert_frame_equal(steps_log(train(killed, progress=False, sample=resumed)), whole)
    assert [c["step"] for c in resumed.calls] == [2]


def test_a_sampler_without_routes_trains_live_and_cannot_be_replayed(tmp_path, init):
    out = train(config(tmp_path / "live", init, steps=1), progress=False, sample=FakeEngine(routes=False))
    log = pd.read_csv(out / "steps.csv")
    assert "mismatch/fraction" not in log and "routes_moved_since_rollout/last_minibatch" not in log
    assert log["policy/kl_consecutive"].notna().all()
    with pytest.raises(ValueError, match="replays the sampler's routes, but sample returned none"):
        train(config(tmp_path / "r3", init, replay="rollout"), progress=False, sample=FakeEngine(routes=False))


def test_malformed_samples_and_a_simulated_sampler_beside_one_are_refused(tmp_path, init):
    def other_prompts(model, prompts, answer_len, step):  # noqa: ANN001, ANN202
        seq, logp, routes = FakeEngine()(model, prompts, answer_len, step)
        return seq.flip(0), logp, routes

    def short_logp(model, prompts, answer_len, step):  # noqa: ANN001, ANN202
        seq, logp, routes = FakeEngine()(model, prompts, answer_len, step)
        return seq, logp[:, 1:], routes

    with pytest.raises(ValueError, match=r"expected the 16 prompts \[16, \d+\], each followed by \d+ tokens"):
        train(config(tmp_path / "a", init), progress=False, sample=other_prompts)
    with pytest.raises(ValueError, match=r"log-probs of shape \[16, \d+\], expected"):
        train(config(tmp_path / "b", init), progress=False, sample=short_logp)
    with pytest.raises(ValueError, match="an external `sample` is the sampler"):
        train(config(tmp_path / "c", init, rollout_dtype="bfloat16"), progress=False, sample=FakeEngine())
