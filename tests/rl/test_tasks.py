"""Tasks: exact answers, deterministic sampling, partial credit."""

from __future__ import annotations

import pytest
import torch

from moe_replay.rl.tasks import Task, decode, encode


@pytest.mark.parametrize("kind", ["addition", "sort", "running_sum"])
def test_answers_are_right_and_sampling_is_deterministic(kind):
    task = Task(kind, 4)
    p1, a1 = task.sample(64, torch.Generator().manual_seed(7))
    p2, a2 = task.sample(64, torch.Generator().manual_seed(7))
    assert torch.equal(p1, p2) and torch.equal(a1, a2)
    assert p1.shape == (64, task.prompt_len) and a1.shape == (64, task.answer_len)
    for prompt, answer in zip(p1.tolist(), a1.tolist(), strict=True):
        text, got = decode(prompt)[1:], decode(answer)
        if kind == "addition":
            a, b = text[:-1].split("+")
            assert int(got) == int(a) + int(b) and len(got) == 5
        elif kind == "sort":
            assert got == "".join(sorted(text[1:]))
        else:
            digits = [int(c) for c in text[1:]]
            assert got == "".join(str(sum(digits[: i + 1]) % 10) for i in range(len(digits)))


def test_rewards():
    task = Task("addition", 3)
    answers = torch.tensor([encode("0532"), encode("1053")])
    completions = torch.tensor([encode("0532"), encode("1000")])
    assert task.reward(completions, answers).tolist() == [1.0, 0.5]  # 2 of 4 digits right in row 2
    assert task.reward(completions, answers, partial=False).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="shorter than answers"):
        task.reward(completions[:, :2], answers)
    with pytest.raises(ValueError, match="unknown task"):
        Task("division")


def test_long_running_sums():
    """64-digit running sums (the long-answer experiment): 64-token answers, each the prefix sum mod 10."""
    task = Task("running_sum", 64)
    prompts, answers = task.sample(3, torch.Generator().manual_seed(0))
    assert prompts.shape == (3, 66) and answers.shape == (3, 64) and task.answer_len == 64
    digits = prompts[:, 2:] - 3  # BOS, ':' then the digits (token id = 3 + symbol index)
    assert torch.equal(answers - 3, digits.cumsum(1) % 10)
    with pytest.raises(ValueError, match=r"1\.\.64, got 65"):
        Task("running_sum", 65)


def test_pair_sums():
    """Each answer digit is the prompt digit plus the one before it, mod 10 (the first as is)."""
    task = Task("pair_sum", 16)
    prompts, answers = task.sample(3, torch.Generator().manual_seed(0))
    digits = prompts[:, 2:] - 3
    before = torch.cat([torch.zeros_like(digits[:, :1]), digits[:, :-1]], 1)
    assert answers.shape == (3, 16) and torch.equal(answers - 3, (digits + before) % 10)
    with pytest.raises(ValueError, match="pair_sum"):
        Task("pairs", 4)
