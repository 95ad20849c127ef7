"""What the experiment scripts share: the command line (`--preset quick|full`, `--out`, `--runs`, `--quiet`), the
`main` of the scripts that train, summarize and plot (`run_script`, `sharded_steps`), the cached warm-started
policies, and writing tables and figures.

Example (in an experiment script, run as `python experiments/<name>.py`, whose folder is then on sys.path):
    >>> from common import parse_args, save_figure, warm_started  # doctest: +SKIP
    >>> args = parse_args(__doc__, PRESETS, runs=lambda preset: Path(f"runs/compare_{preset}"))  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from torch import nn

from moe_replay import expert_change, teacher_forced_routes
from moe_replay.rl import DEFAULT_EPSILON, Rollout, Task, TrainConfig, answer_logp, build_policy, train, warm_start
from moe_replay.rl.diagnostics import heldout_eval

RESULTS = Path("experiments/results")  # the committed results: written only when asked (--out experiments/results)
OUT = Path("runs/results")  # where a run's tables and figures go by default
WARM_STARTS = Path("runs/warm_starts")  # warm-started policies, shared by the experiments that start from one
BASE_TASK = Task("addition", 3)  # the task every experiment warm-starts on unless it says otherwise
CHANCE = 0.1  # per-digit reward of random answers
LEARNED = CHANCE + 0.05  # a warm start whose per-digit reward is below this has not learned its task
LOW, HIGH = DEFAULT_EPSILON["token"]  # GRPO's clip band (DAPO's clip-higher): 0.2, 0.27
# round 3's arms (long_answers.py, decisive.py) as TrainConfig settings; R2 replays the old-log-prob forward's routes
ROUND3_ARMS = {
    "GRPO": {"importance_sampling_level": "token", "replay": "off"},
    "GRPO + R2": {"importance_sampling_level": "token", "replay": "old_logprob"},
    "GSPO": {"importance_sampling_level": "sequence", "replay": "off"},
}


def parse_args(
    doc: str,
    presets: Mapping[str, Any],
    *,
    runs: Path | Callable[[str], Path],
    extra: Callable[[argparse.ArgumentParser], object] | None = None,
    argv: Sequence[str] | None = None,
) -> argparse.Namespace:
    """Parse the options every experiment has: `--preset` (default "full"), `--out` (default runs/results: committing
    new results is an explicit `--out experiments/results`), `--runs` (default `runs`, or `runs(preset)`), `--quiet`
    and `--replot` (redraw from the committed CSVs in experiments/results, `committed`), plus the script's own, added
    by `extra`. Sets torch's thread count to OMP_NUM_THREADS (default 1): the thread count changes the trajectories.

    Example:
        >>> args = parse_args(__doc__, PRESETS, runs=lambda p: Path(f"runs/sweep_{p}"),  # doctest: +SKIP
        ...                   extra=lambda ap: ap.add_argument("--only", nargs="+"))
        >>> PRESETS[args.preset], args.out, args.runs  # doctest: +SKIP
    """
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--preset", choices=list(presets), default="full", help="quick: a smoke test; full: the results")
    ap.add_argument(
        "--out", type=Path, default=OUT, help=f"where tables and figures go (default {OUT}; to commit: --out {RESULTS})"
    )
    default = runs if isinstance(runs, Path) else runs("<preset>")
    ap.add_argument("--runs", type=Path, help=f"where runs and warm starts go (default {default})")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    ap.add_argument("--replot", action="store_true", help=f"no runs: redraw from the committed CSVs in {RESULTS}")
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    # one thread unless OMP_NUM_THREADS says otherwise: the thread count changes the trajectories (reduction order)
    threads = os.environ.get("OMP_NUM_THREADS", "1").split(",")[0]
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    if args.runs is None:
        args.runs = runs if isinstance(runs, Path) else runs(args.preset)
    return args


def shard_option(ap: argparse.ArgumentParser) -> None:
    """The option of the scripts that split their runs by seed over processes: `--shard K/N` (default 0/1, all), read
    as the pair (K, N); K >= N or N < 1 is a usage error.

    Example:
        >>> args = parse_args(__doc__, PRESETS, runs=Path("runs/x"), extra=shard_option)  # doctest: +SKIP
        >>> k, n = args.shard  # doctest: +SKIP
    """

    def pair(text: str) -> tuple[int, int]:
        k, _, n = text.partition("/")
        if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
            raise argparse.ArgumentTypeError(f"--shard wants K/N with 0 <= K < N, got {text!r}")
        return int(k), int(n)

    ap.add_argument("--shard", type=pair, default=(0, 1),
                    help="run the seeds s with s %% N == K (K/N), e.g. 0/2 and 1/2 at once")  # fmt: skip


def run_script(
    doc: str,
    presets: Mapping[str, Any],
    name: str,
    run_all: Callable[[str, Path, bool], pd.DataFrame],
    summarize: Callable[[pd.DataFrame], pd.DataFrame],
    figure: Callable[[pd.DataFrame], Figure],
    dpi: int = 120,
) -> None:
    """The `main` of a script whose `run_all(preset, runs, progress)` trains every run and returns their step logs:
    parse the common options (runs by default in `runs/<name>_<preset>`), take the steps from the runs (written to
    `<out>/<name>_steps.csv`) or, with `--replot`, from the committed CSV, and publish the summary and figure.

    Example:
        >>> run_script(__doc__, PRESETS, "compare", run_all, summarize, figure, dpi=110)  # doctest: +SKIP
    """
    args = parse_args(doc, presets, runs=lambda preset: Path(f"runs/{name}_{preset}"))
    if args.replot:
        frame = committed(f"{name}_steps.csv")
    else:
        frame = run_all(args.preset, args.runs, not args.quiet)
        write_table(frame, args.out / f"{name}_steps.csv")
    publish(summarize(frame), figure(frame), args.out, name, dpi=dpi)


def sharded_steps(
    args: argparse.Namespace, name: str, run_all: Callable[..., pd.DataFrame | None]
) -> pd.DataFrame | None:
    """The steps of a script that splits its runs with `--shard`: with `--replot` the committed `<name>_steps.csv`;
    else this shard's `run_all(preset, runs, progress, shard)`, written to `<out>/<name>_steps.csv` when the shard is
    the whole plan, or None (saying so) when the other shards' runs are left to collect.

    Example:
        >>> frame = sharded_steps(args, "decisive", run_all)  # doctest: +SKIP
    """
    if args.replot:
        return committed(f"{name}_steps.csv")
    k, n = args.shard
    frame = run_all(args.preset, args.runs, not args.quiet, (k, n))
    if frame is None:
        print(f"shard {k}/{n} done; run without --shard to collect")
        return None
    write_table(frame, args.out / f"{name}_steps.csv")
    return frame


def train_log(output: Path, init: Path, progress: bool, **settings: Any) -> pd.DataFrame:
    """Train (or resume) the run `TrainConfig(output=output, init=init, **settings)`; its step log (steps.csv).

    Example:
        >>> log = train_log(runs / "grpo_seed0", runs / "init_seed0", True, seed=0, steps=200)  # doctest: +SKIP
    """
    cfg = TrainConfig(output=str(output), init=str(init), **settings)
    return pd.read_csv(train(cfg, progress=progress) / "steps.csv")


def committed(name: str) -> pd.DataFrame:
    """A committed results CSV (`--replot` redraws from these).

    Example:
        >>> frame = committed("compare_steps.csv")  # doctest: +SKIP
    """
    print(f"replotting from {RESULTS / name}")
    return pd.read_csv(RESULTS / name)


def warm_started(
    cache: Path,
    *,
    layers: int = 4,
    experts: int = 16,
    top_k: int = 2,
    steps: int = 300,
    seed: int = 0,
    task: Task = BASE_TASK,
) -> Path:
    """The folder (save_pretrained) of the default policy with `layers` layers, `experts` experts and top-`top_k`,
    warm-started on `task` (default 3-digit addition) for up to `steps` steps (stopping at sampled reward 0.35):
    made once, then reused from `cache`. The folder name holds every setting, so a quick preset's short warm start
    never stands in for a full one.

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained(warm_started(WARM_STARTS, layers=8))  # doctest: +SKIP
    """
    kind = "" if task == BASE_TASK else f"_{task.kind}{task.size}"
    path = cache / f"init_L{layers}_E{experts}_k{top_k}{kind}_w{steps}_seed{seed}"
    if not (path / "config.json").exists():
        model = build_policy(
            {"num_hidden_layers": layers, "num_experts": experts, "num_experts_per_tok": top_k}, seed=seed
        )
        warm_start(model, task, steps=steps, target_reward=0.35, seed=seed)
        model.save_pretrained(path)
    return path


def warm_start_heldout(model: nn.Module, cfg: TrainConfig) -> float:
    """The held-out reward per digit of `model` (a run's warm start) as the run of `cfg` would log it at step 0: its
    sampled answers to the run's `heldout_prompts` held-out prompts, drawn with the evaluation seed of step 0.

    Example:
        >>> warm_start_heldout(initial_policy(cfg), cfg)  # doctest: +SKIP
        0.371
    """
    task = Task(cfg.task, cfg.task_size)
    prompts, answers = task.heldout(cfg.heldout_prompts, seed=cfg.seed + 10_000)
    return heldout_eval(model, task, prompts, answers, seed=cfg.seed + 20_000)["eval/sampled/reward"]


def replace_failed_warm_starts(
    seeds: Sequence[int],
    heldout_reward: Callable[[int], float],
    *,
    used: Collection[int] = (),
    threshold: float = LEARNED,
    limit: int = 20,
) -> tuple[list[int], dict[int, float]]:
    """Round 4's exclusion rule (experiments/round4_plan.md): each of `seeds` whose warm start ends below `threshold`
    held-out reward per digit (`heldout_reward(seed)`, e.g. `warm_start_heldout`) is replaced by the next unused seed
    index (after the largest of `seeds`, skipping `used` ones), itself judged the same way. Returns the seeds to run,
    in order, and the replaced ones with their warm-start reward. More than `limit` replacements is a RuntimeError
    (a setting whose warm starts fail is not a test).

    Example:
        >>> replace_failed_warm_starts([0, 1, 2], {0: 0.3, 1: 0.12, 2: 0.4, 3: 0.2}.get)
        ([0, 3, 2], {1: 0.12})
    """
    taken = set(seeds) | set(used)
    spare = max(seeds, default=-1) + 1
    kept, replaced = [], {}
    for seed in seeds:
        while (reward := heldout_reward(seed)) < threshold:
            replaced[seed] = reward
            if len(replaced) > limit:
                raise RuntimeError(f"more than {limit} warm starts below {threshold}: {replaced}")
            while spare in taken:
                spare += 1
            seed = spare
            taken.add(seed)
        kept.append(seed)
    return kept, replaced


def same_weight_views(model: nn.Module, batch: Rollout, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Minibatch `idx` of `batch` at the model's current weights: the token log-ratios log π_θ/π_old [n, A] routed
    live and replaying the rollout's routes (the difference is routing's alone), and the share of expert slots whose
    live pick moved since the rollout. Leaves the model in eval mode.

    Example:
        >>> live, replayed, moved = same_weight_views(model, batch, idx)  # doctest: +SKIP
    """
    seq, tp, old = batch.sequences[idx], batch.prompt_len, batch.old_logp[idx]
    model.eval()
    with torch.no_grad():
        live = answer_logp(model, seq, tp) - old
        replayed = answer_logp(model, seq, tp, batch.routes[idx]) - old
    return live, replayed, expert_change(batch.routes[idx], teacher_forced_routes(model, seq)).fraction


def outside_clip(log_ratio: torch.Tensor) -> float:
    """The share of tokens whose ratio exp(`log_ratio`) lies outside GRPO's clip band [1 − LOW, 1 + HIGH]."""
    ratio = log_ratio.exp()
    return float(((ratio < 1 - LOW) | (ratio > 1 + HIGH)).float().mean())


def running_mean(frame: pd.DataFrame, column: str = "reward_mean", window: int = 5) -> pd.Series:
    """`column` as a `window`-step running mean within each run (the rows sharing setting, arm and seed, whichever
    of those columns the frame has).

    Example:
        >>> frame.assign(smooth=running_mean(frame, window=10))  # doctest: +SKIP
    """
    keys = [k for k in ("setting", "arm", "seed") if k in frame.columns]
    return frame.groupby(keys)[column].transform(lambda r: r.rolling(window, min_periods=1).mean())


def seed_label(name: object, seeds: int) -> str:
    """A legend entry that says how many seeds an arm's mean is over: "GSPO (3 seeds)"."""
    return f"{name} ({seeds} seed{'s' if seeds != 1 else ''})"


def seed_lines(
    ax: Axes,
    frame: pd.DataFrame,
    y: str,
    *,
    x: str = "step",
    group: str = "arm",
    seed: str = "seed",
    scale: float = 1.0,
    runs: bool = True,
    colors: Mapping[object, str] | None = None,
    styles: Mapping[object, Mapping[str, Any]] | None = None,
) -> None:
    """Per `group` (in the frame's order): each seed's run as a thin line (unless `runs` is False) and the mean over
    seeds as a bold one (thinner without the runs), labelled with its seed count (`seed_label`); no ± sd band, which
    hides bimodal seeds and can leave the range a metric can take. `colors` and `styles` (extra plot keywords) may be
    given per group.

    Example:
        >>> seed_lines(ax, evals, "eval/sampled/reward", colors={"GRPO": "C0"})  # doctest: +SKIP
    """
    for i, (name, part) in enumerate(frame.groupby(group, sort=False)):
        kw = {"color": (colors or {}).get(name, f"C{i}"), **(styles or {}).get(name, {})}
        if runs:
            for _, run in part.groupby(seed):
                run = run.sort_values(x)
                ax.plot(run[x], run[y] * scale, lw=0.6, alpha=0.35, **kw)
        mean = part.groupby(x)[y].mean().sort_index() * scale
        ax.plot(mean.index, mean.values, lw=1.8 if runs else 1.2, label=seed_label(name, part[seed].nunique()), **kw)


def write_table(frame: pd.DataFrame, path: Path) -> Path:
    """Write `frame` as CSV (no index) to `path`, making its folder; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)
    return path


def publish(summary: pd.DataFrame, fig: Figure, out: Path, name: str, dpi: int = 120) -> None:
    """Write `<out>/<name>_summary.csv` and `<out>/<name>.png`, print the summary, and list what `<out>` holds.

    Example:
        >>> publish(summarize(frame), figure(frame), args.out, "compare", dpi=110)  # doctest: +SKIP
    """
    write_table(summary, out / f"{name}_summary.csv")
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    save_figure(fig, out / f"{name}.png", dpi=dpi)
    print(f"wrote {out}/{name}_steps.csv, {name}_summary.csv, {name}.png")


def save_figure(fig: Figure, path: Path, dpi: int = 120) -> Path:
    """Save a matplotlib `Figure` (PNG, PDF, SVG by suffix) to `path`, making its folder; returns `path`.

    Example:
        >>> save_figure(figure(frame), args.out / "compare.png", dpi=110)  # doctest: +SKIP
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
