"""Verifiable synthetic tasks with a tiny character tokenizer: addition, sorting, running sums.

Every task has fixed-length prompts and fixed-length answers, so a batch needs no padding and rewards are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD, BOS, EOS = 0, 1, 2
SYMBOLS = "0123456789+=,>:"
VOCAB = 3 + len(SYMBOLS)  # pad, bos, eos, then the symbols
KINDS = ("addition", "sort", "running_sum", "pair_sum")


def encode(text: str) -> list[int]:
    """Characters to token ids (no BOS/EOS).

    Example:
        >>> encode("12+3=")
        [4, 5, 13, 6, 14]
    """
    try:
        return [3 + SYMBOLS.index(c) for c in text]
    except ValueError as e:
        raise ValueError(f"{text!r} has a character outside the task alphabet {SYMBOLS!r}") from e


def decode(ids: list[int] | torch.Tensor) -> str:
    """Token ids to characters; pad / bos / eos become '', '^', '$'.

    Example:
        >>> decode([1, 4, 5, 2])
        '^12$'
    """
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    special = {PAD: "", BOS: "^", EOS: "$"}
    return "".join(special.get(i, SYMBOLS[i - 3] if 3 <= i < VOCAB else "?") for i in ids)


@dataclass(frozen=True)
class Task:
    """A verifiable task: `kind` in {"addition", "sort", "running_sum", "pair_sum"}, `size` digits per operand / list
    length.

    - addition: "a+b=" with `size`-digit operands (zero-padded), answer a+b in `size`+1 digits.
    - sort: ">" then `size` digits, answer the digits sorted.
    - running_sum: ":" then `size` digits, answer the prefix sums mod 10 (each answer digit depends on all before it:
      the tiny policy does not learn it beyond about 8 digits).
    - pair_sum: ":" then `size` digits, answer each digit plus the one before it, mod 10 (the first as is): each
      answer digit depends on two prompt digits, so long answers stay learnable.

    Example:
        >>> task = Task("addition", 3)
        >>> prompts, answers = task.sample(2, torch.Generator().manual_seed(0))
        >>> task.reward(answers, answers).tolist()
        [1.0, 1.0]
    """

    kind: str = "addition"
    size: int = 3

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown task {self.kind!r}: use one of {KINDS}")
        if not 1 <= self.size <= 64:
            raise ValueError(f"task size must be in 1..64, got {self.size}")

    @property
    def prompt_len(self) -> int:
        """Tokens per prompt, BOS included."""
        return 1 + (2 * self.size + 2 if self.kind == "addition" else self.size + 1)

    @property
    def answer_len(self) -> int:
        """Tokens per answer, EOS excluded."""
        return self.size + 1 if self.kind == "addition" else self.size

    def sample(
        self, n: int, generator: torch.Generator, exclude: frozenset[tuple[int, ...]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` prompts [n, prompt_len] and their answers [n, answer_len], deterministic given the generator; a
        prompt in `exclude` (token tuples, e.g. held-out prompts) is drawn again from the same generator."""
        prompts, answers = self._draw(n, generator)
        while exclude:
            hit = [i for i, p in enumerate(prompts.tolist()) if tuple(p) in exclude]
            if not hit:
                break
            new_p, new_a = self._draw(len(hit), generator)
            prompts[hit], answers[hit] = new_p, new_a
        return prompts, answers

    @property
    def prompt_space(self) -> int:
        """How many distinct prompts the task has (at most half of them can be held out).

        Example:
            >>> Task("addition", 2).prompt_space
            10000
        """
        return 10 ** (2 * self.size if self.kind == "addition" else self.size)

    def heldout(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` distinct prompts and answers drawn from their own generator (`seed`): an evaluation set that
        training excludes with `sample(..., exclude=...)`.

        Example:
            >>> prompts, answers = Task("addition", 2).heldout(4, seed=0)
            >>> len({tuple(p) for p in prompts.tolist()})
            4
        """
        space = self.prompt_space
        if n > space // 2:
            raise ValueError(f"{n} held-out prompts would be over half of the task's {space} prompts")
        g = torch.Generator().manual_seed(seed)
        seen: dict[tuple[int, ...], int] = {}
        rows_p, rows_a = [], []
        while len(rows_p) < n:
            p, a = self._draw(n, g)
            for pi, ai in zip(p.tolist(), a.tolist(), strict=True):
                if tuple(pi) not in seen and len(rows_p) < n:
                    seen[tuple(pi)] = len(rows_p)
                    rows_p.append(pi)
                    rows_a.append(ai)
        return torch.tensor(rows_p), torch.tensor(rows_a)

    def _draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        digits = torch.randint(0, 10, (n, 2 * self.size if self.kind == "addition" else self.size), generator=generator)
        prompts, answers = [], []
        for row in digits.tolist():
            if self.kind == "addition":
                a = int("".join(map(str, row[: self.size])))
                b = int("".join(map(str, row[self.size :])))
                text = f"{a:0{self.size}d}+{b:0{self.size}d}="
                answer = f"{a + b:0{self.size + 1}d}"
            elif self.kind == "sort":
                text, answer = ">" + "".join(map(str, row)), "".join(map(str, sorted(row)))
            elif self.kind == "running_sum":
                sums, total = [], 0
                for d in row:
                    total = (total + d) % 10
                    sums.append(total)
                text, answer = ":" + "".join(map(str, row)), "".join(map(str, sums))
            else:
                pairs = [(d + (row[i - 1] if i else 0)) % 10 for i, d in enumerate(row)]
                text, answer = ":" + "".join(map(str, row)), "".join(map(str, pairs))
            prompts.append([BOS, *encode(text)])
            answers.append(encode(answer))
        return torch.tensor(prompts), torch.tensor(answers)

    def reward(self, completions: torch.Tensor, answers: torch.Tensor, *, partial: bool = True) -> torch.Tensor:
        """[n] rewards of completions [n, >= answer_len] against answers [n, answer_len]: the share of correct
        positions (`partial`), or 1.0 for an exact match only."""
        got = completions[:, : self.answer_len]
        if got.shape != answers.shape:
            raise ValueError(f"completions {tuple(completions.shape)} are shorter than answers {tuple(answers.shape)}")
        correct = (got == answers.to(got.device)).float()
        return correct.mean(1) if partial else correct.all(1).float()
