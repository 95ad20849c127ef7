"""Packed replay on every MoE causal-LM family of the installed transformers, each as a tiny fp32 model: replaying
`to_packed` of a right-padded batch's routes on the packed row (restarting position_ids, no mask, no cache) gives the
padded forward's per-token log-probs (the same routes replayed there) for the families `packed_families()` lists for the
installed transformers, and is
refused, naming the model type, for every other family (state flowing along the row, masks built without the
position_ids, sparse-attention top-k ties broken differently on the longer row)."""

from __future__ import annotations

import re

import pytest
import torch
from families import discover_moe_families
from helpers import perturb
from test_families import build, pad_id
from transformers.utils import logging

from moe_replay import record_routes, replay_routes, to_packed
from moe_replay.engines.packed_families import packed_families
from moe_replay.errors import ReplayError

logging.set_verbosity_error()

FAMILIES = discover_moe_families()
# Longer than the tiny configs' sliding windows and attention chunks (8), index top-k (4) and index pool (8), so those
# paths run on the packed row too.
LENGTHS = (6, 13, 10)
# Measured max |packed - padded| log-prob (fp32, routes replayed both ways, this batch and perturbation): the listed
# families at most 1.4e-6; the refused ones from 5.7e-3 (inkling_text's short convolution), the next 8.8e-2. Without the
# perturbation (weights of sd 0.02) leaks are far smaller (inkling_text 4e-6, lfm2_moe 3e-5, jamba 3e-4) and the
# indexers' top-k ties (deepseek_v32, glm_moe_dsa, axk2, dots3_note, hy_v4) may not show at all. rtol=0: log-probs of
# about -5 would turn rtol=1e-4 into 5e-4 of slack.
TOLERANCE = 1e-4


def right_padded(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Three right-padded sequences of LENGTHS [3, 13] (ids in the vocab, clear of special ids) and their mask."""
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, min(vocab, 100), (len(LENGTHS), max(LENGTHS)), generator=g)
    keep = (torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]).long()
    return ids.masked_fill(keep == 0, pad_id(model)), keep


def token_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token [..., T - 1]."""
    return logits.float().log_softmax(-1)[..., :-1, :].gather(-1, ids[..., 1:, None])[..., 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_replay_gives_the_padded_log_probs_or_is_refused(family):
    model = build(family)
    perturb(model, scale=2.0, seed=3, min_std=0.05)  # larger weights: a leak along the row shows plainly
    model_type = model.config.model_type
    ids, keep = right_padded(model)
    row = ids[keep.bool()][None]
    restarting = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        with record_routes(model) as rec:
            model(ids, attention_mask=keep, use_cache=False)
        packed = to_packed(rec.routes, keep)
        if model_type not in packed_families():
            with pytest.raises(ReplayError, match=rf"\b{re.escape(model_type)}\b"), replay_routes(model, packed):
                model(row, position_ids=restarting, use_cache=False)
            return
        with replay_routes(model, rec.routes):
            padded = token_logp(model(ids, attention_mask=keep, use_cache=False).logits, ids)[keep[:, 1:].bool()]
        with replay_routes(model, packed):
            logp = token_logp(model(row, position_ids=restarting, use_cache=False).logits, row)[0]
    inside = torch.cat([torch.arange(n) < n - 1 for n in LENGTHS])[:-1]  # the next token is in the same sequence
    torch.testing.assert_close(logp[inside], padded, atol=TOLERANCE, rtol=0)


def test_the_installed_transformers_is_verified_and_its_packed_families_are_its_model_types():
    """Every CI lane's transformers has its verified list (else packed replay is refused outright), and a stale entry
    (a model type this transformers does not have, or whose causal LM is no longer MoE) fails."""
    accepted = packed_families()
    assert accepted, "this transformers release has no verified packed families: verify them (engines/packed_families)"
    assert accepted <= set(FAMILIES), sorted(accepted - set(FAMILIES))
