"""`moe-replay drift`: how many routed experts one optimizer step moves, for a saved model.

Example:
    $ moe-replay drift path/to/model --batch 16 --length 64 --lr 1e-4 --plot drift.png --csv drift.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .args import at_least


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the `drift` subcommand."""
    p = sub.add_parser(
        "drift",
        help="expert change caused by one optimizer step on a saved MoE model",
        description="Load a save_pretrained MoE model, take one optimizer step on the next-token loss of a batch, and "
        "print how many routed experts moved on that batch (teacher-forced before vs after).",
    )
    p.add_argument("model", help="a save_pretrained directory (or anything AutoModelForCausalLM.from_pretrained takes)")
    p.add_argument("--prompts", type=Path, help="text file, one prompt per line (needs the model's tokenizer)")
    p.add_argument("--batch", type=at_least(1), default=8, help="synthetic batch: sequences (default 8)")
    p.add_argument(
        "--length", type=at_least(2), default=64, help="tokens per sequence (default 64; at least 2: a next token)"
    )
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--buckets", type=at_least(1), default=4, help="position buckets in the table (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, help="also write the tidy table as CSV")
    p.add_argument("--plot", type=Path, help="write the per-layer figure (PNG, PDF, SVG)")


def run(args: argparse.Namespace) -> int:
    """Run `moe-replay drift` with parsed arguments."""
    from transformers import AutoModelForCausalLM

    from ..analysis import measure_update_drift

    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise ValueError(f"--device {args.device!r} is not a torch device") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this torch build or machine has no CUDA device (use --device cpu)")
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device)
    ids, mask = _batch(args, model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD)(params, lr=args.lr)

    def update() -> None:
        model.train()
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"one {args.optimizer} step at lr {args.lr:g}: next-token loss {loss.item():.4f}")

    change = measure_update_drift(model, ids, mask, update=update)
    print(change)
    frame = change.to_frame(buckets=args.buckets)
    table = frame[frame.metric != "token_changed"].pivot_table(
        index="layer", columns=["metric", "position_bucket"], values="value", sort=False
    )
    print((table * 100).round(2).to_string(float_format=lambda v: f"{v:.2f}"))
    print("(values in %: fraction = routed experts changed, set_changed = expert sets changed)")
    if args.csv:
        frame.to_csv(args.csv, index=False)
        print(f"wrote {args.csv}")
    if args.plot:
        from ..analysis import plots

        plots.per_layer(change, title=f"Expert change after one {args.optimizer} step (lr {args.lr:g})").savefig(
            args.plot, dpi=120
        )
        print(f"wrote {args.plot}")
    return 0


def _batch(args: argparse.Namespace, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, T] from a prompt file (right-padded) or random tokens."""
    if args.prompts is None:
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (args.batch, args.length))
        return ids.to(args.device), torch.ones_like(ids)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--prompts needs a tokenizer saved with the model in {args.model}: {e}") from e
    lines = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"{args.prompts} has no prompts")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"  # (columns are then positions: the per-position buckets are the tokens' positions)
    enc = tok(lines, return_tensors="pt", padding=True, truncation=True, max_length=args.length)
    if enc["input_ids"].shape[1] < 2:
        raise SystemExit(
            f"the tokenizer in {args.model} turned the prompts into {enc['input_ids'].shape[1]} tokens each: it needs "
            "at least 2 (a token and the next); is it the model's tokenizer?"
        )
    return enc["input_ids"].to(args.device), enc["attention_mask"].to(args.device)
