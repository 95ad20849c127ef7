"""TRL's own tool-calling loop (`GRPOTrainer(tools=...)`, or an `environment_factory`'s methods) under routing
replay: each turn's `generate` is recorded, the turns are assembled by the segment rule, and every loss forward
replays the result. The tiny character model is made to call a tool by a scripted response parser (a completion
holding "9" calls `echo`) and a chat template that renders tool calls; the tool's reply is the fixed tokens "+42="
(TRL's `_get_tool_suffix_ids`, replaced)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trl.trainer.grpo_trainer as grpo_module
from datasets import Dataset
from trl_utils import MASK, Spy, agreement, config, reward, tiny_policy

from moe_replay.integrations.trl.tools import tool_loop_routes
from moe_replay.routes import LayerInfo, Routes
from moe_replay.tiny import tiny_tokenizer

CALL = "9"


def echo() -> str:
    """Echo a number.

    Returns:
        The number.
    """
    return "42"


@pytest.fixture
def tool_tokenizer(monkeypatch):  # noqa: ANN001, ANN201
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% for t in m.get('tool_calls') or [] %}{{ t.function.name }}"
        "{{ t.function.arguments | tojson }}{% endfor %}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    tok.response_schema = {"type": "object"}  # (TRL parses completions only with one; the parser below is scripted)
    call = tok(CALL).input_ids[0]

    def parse(tokenizer, ids, prefix=None, tools=None):  # noqa: ANN001, ANN202
        out = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        if call in ids:
            out["tool_calls"] = [{"type": "function", "function": {"name": "echo", "arguments": {}}}]
        return out

    monkeypatch.setattr(grpo_module, "parse_response", parse)
    return tok


class ToolSpy(Spy):
    """A `Spy` whose tool reply is fixed tokens and which counts the rows of each turn TRL generates."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.turn_rows: list[int] = []

    def _get_tool_suffix_ids(self, tool_messages):  # noqa: ANN001, ANN202
        return self.processing_class("+42=").input_ids

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        self.turn_rows.append(len(prompt_ids))
        return super()._generate_single_turn(prompt_ids, *args, **kwargs)


class EchoEnvironment:
    """A TRL environment whose one tool is `echo` (TRL runs its tool loop over the environments' methods)."""

    def reset(self, **kwargs: Any) -> None:
        return None

    def echo(self) -> str:
        """Echo a number.

        Returns:
            The number.
        """
        return "42"


@pytest.mark.parametrize(
    "mode, multiple, source",
    [("rollout", None, "tools"), ("rollout", 8, "tools"), ("old_logprob", None, "tools"), ("rollout", None, "env")],
)
def test_trls_tool_loop_trains_on_the_routes_of_every_turn(tmp_path, tool_tokenizer, mode, multiple, source):
    questions = ["1+7", "23+89", "456+123", "1+89"] * 2
    trainer = ToolSpy(
        model=tiny_policy(),
        reward_funcs=reward,
        args=config(tmp_path, max_completion_length=24, max_tool_calling_iterations=2, max_steps=2,
                    pad_to_multiple_of=multiple,
                    generation_kwargs={"sequence_bias": {(tool_tokenizer(CALL).input_ids[0],): 2.0, (1,): 2.0}}),
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]}),
        processing_class=tool_tokenizer,
        **({"tools": [echo]} if source == "tools" else {"environment_factory": EchoEnvironment}),
        routing_replay=mode,
    )  # fmt: skip
    trainer.train()
    assert len(trainer.turn_rows) > len(trainer.generated)  # the tool loop ran later turns, on some rows each
    assert any(0 < n < 4 for n in trainer.turn_rows)
    for gen in trainer.generated:
        # every kept position's experts are those a live forward at the sampling weights picks (its near-ties aside;
        # a misplaced turn would disagree almost everywhere), the tool's reply tokens included
        assert agreement(gen) == 1.0
        assert agreement(gen, shift=1) < 0.5
        P, tool = gen["prompt_ids"].shape[1], gen["tool_mask"] == 0
        recorded = gen[MASK][:, P:] | ~gen["completion_mask"].bool()
        assert tool.any() and recorded[tool & gen["completion_mask"].bool()].all()
    for replayed, used in trainer.used:  # every loss forward ran on them
        m = replayed.mask
        assert m.any() and torch.equal(used.mask & m, m)
        assert torch.equal(used.indices.long().sort(-1).values[m], replayed.indices.long().sort(-1).values[m])


def test_a_turn_that_matches_no_final_row_is_refused():
    layers = (LayerInfo("a", 8, 2),)
    routes = Routes(torch.zeros(1, 4, 1, 2, dtype=torch.long).add_(torch.tensor([0, 1])), torch.ones(1, 4).bool(),
                    layers)  # fmt: skip
    with pytest.raises(Exception, match=r"tool-loop turn 1, row 0: its input of 3 tokens and output of 1 start none"):
        tool_loop_routes([(routes, [[5, 6]], [[7, 8]]), (routes, [[5, 6, 9]], [[4]])], [[5, 6]], [[7, 8]])
