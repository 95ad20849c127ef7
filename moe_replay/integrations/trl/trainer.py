"""`RoutingReplayGRPOTrainer`: TRL's `GRPOTrainer` with Routing Replay, one argument away.

TRL methods overridden (TRL 1.16): `_generate_single_turn` (record while generating), `_generate_and_score_completions`
(attach the routes to the batch), `_get_per_token_logps_and_entropies` (replay or record the old-log-prob pass),
`compute_loss` and `training_step` (replay the loss forward and keep the replay open through the backward). The routes
travel inside TRL's batch dict as tensors (`routing_indices` [B, P + C, L, K], `routing_mask` [B, P + C] and the tokens
they were recorded for, `routing_tokens` [B, P + C], checked at each loss forward), so TRL's own shuffling, splitting
into `steps_per_generation` buffers and gradient accumulation move them with their rows.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any

import torch
from trl import GRPOTrainer

from ...engines import record_routes, replay_routes
from ...errors import ReplayError
from ...routes import LayerInfo, Routes
from .layout import check_rows, routes_for_batch
from .refusals import refuse_arguments, refuse_settings, refuse_stop_tokens
from .rollout import taking_routes
from .tools import tool_loop_routes

MODES = (None, "rollout", "old_logprob")
INDICES, MASK = "routing_indices", "routing_mask"  # the batch keys that carry the routes
TOKENS = "routing_tokens"  # and the tokens they were recorded for (`check_rows`)


class RoutingReplayGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` that replays the routes of an MoE policy in its old-log-prob and loss forwards.

    `routing_replay`:
    - `"rollout"` (R3): record the experts while TRL generates; the old-log-prob and loss forwards replay them.
    - `"old_logprob"` (R2, the GSPO paper's Routing Replay): record them in the old-log-prob forward; the loss
      forwards replay them. TRL computes old log-probs only when `gradient_accumulation_steps` is not a multiple
      of `steps_per_generation * num_iterations`; otherwise this mode raises at init.
    - `None`: exactly `trl.GRPOTrainer`.

    The reference model's forward (β ≠ 0, also PEFT's adapter-disabled reference) routes live: the KL term compares
    to the reference policy as it is, and the routes are the current policy's. Every other argument is
    `GRPOTrainer`'s. Logged next to TRL's metrics: `routing/routes_moved_since_rollout` (share of replayed expert
    choices that each router, on its input in the replayed loss forward, would have chosen otherwise) and, with
    `"rollout"` when TRL computes old log-probs, `routing/mismatch/fraction` (the same in the old-log-prob forward at
    the sampling weights: the sampler/trainer routing mismatch).

    A custom `rollout_func` (the user's own engine call, or an agent loop) hands its routes over in its output's
    `"routes"` (`integrations.trl.rollout`: the layout, and R2's refusal of them); `use_vllm=True` is allowed with one
    (TRL's weight sync to the user's engine). TRL's tool loop (`tools=[...]` or an `environment_factory`): every turn
    is recorded and the turns are assembled by the segment rule (`integrations.trl.tools`). Refused with a
    ValueError: `use_vllm` without a `rollout_func` (TRL's own vLLM path returns no routes), continuous batching,
    tools or environments with a `rollout_func`, and multimodal inputs.

    Example:
        >>> trainer = RoutingReplayGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(num_iterations=2),
        ...                                    train_dataset=ds, processing_class=tok, routing_replay="rollout")
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(self, *args: Any, routing_replay: str | None = None, **kwargs: Any) -> None:
        if routing_replay not in MODES:
            raise ValueError(f"routing_replay must be one of {MODES}, got {routing_replay!r}")
        self.routing_replay = routing_replay
        self._rr_generated: tuple | None = None  # (routes under generate, prompt ids, completion ids)
        self._rr_turns: list = []  # each `_generate_single_turn` of the running `_generate` (tools.Turn)
        self._rr_rows: Routes | None = None  # the routes of the batch being generated, in TRL's layout
        self._rr_layers: tuple[LayerInfo, ...] | None = None
        self._rr_phase: str | None = None
        self._rr_stack: contextlib.ExitStack | None = None
        self._rr_open: list = []
        self._rr_uncompared = False  # warned that the routing metrics could not be computed (`_log_moved`)
        if routing_replay is not None:
            given = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
            refuse_arguments(given)
            if given.get("args") is not None:
                refuse_settings(given["args"], routing_replay, given.get("rollout_func") is not None)
        super().__init__(*args, **kwargs)
        if routing_replay is not None:
            refuse_settings(self.args, routing_replay, self.rollout_func is not None)
            refuse_stop_tokens(getattr(self, "generation_config", None), self.eos_token_ids)
            if self.rollout_func is not None:
                self.rollout_func = taking_routes(self.rollout_func, routing_replay, self._keep_rollout_routes)

    # ---- generation ----------------------------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):  # noqa: ANN001, ANN202, E501
        args = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if self.routing_replay != "rollout":
            return super()._generate_single_turn(*args)
        with record_routes(self._core(self.model)) as rec:
            completion_ids, logprobs = super()._generate_single_turn(*args)
        if len(rec.batches) != 1:
            raise ReplayError(f"expected one generate call to record, got {len(rec.batches)}")
        # (several in TRL's tool loop, which then edits these lists in place: copied as this turn ran)
        self._rr_turns.append((rec.routes, [list(p) for p in prompt_ids], [list(c) for c in completion_ids]))
        return completion_ids, logprobs

    def _generate(self, prompts):  # noqa: ANN001, ANN202
        if self.routing_replay != "rollout" or self.rollout_func is not None:
            return super()._generate(prompts)
        self._rr_turns = []
        try:
            out = super()._generate(prompts)
            prompt_ids, completion_ids, turns = out[0], out[1], self._rr_turns
            if len(turns) == 1:
                self._rr_generated = turns[0]
            elif turns:  # TRL's tool loop: a turn per tool reply, assembled as one generate over the final rows
                routes = tool_loop_routes(turns, prompt_ids, completion_ids, self.pad_to_multiple_of)
                self._rr_generated = (routes, prompt_ids, completion_ids)
        finally:
            self._rr_turns = []
        return out

    def _keep_rollout_routes(self, generated: tuple) -> None:
        self._rr_generated = generated  # (routes, prompt ids, completion ids), as `_generate_single_turn` keeps them

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        if self.routing_replay is None:
            return super()._generate_and_score_completions(inputs)
        if inputs and ("image" in inputs[0] or "images" in inputs[0]):
            raise ValueError("routing_replay does not support multimodal inputs (the batch has images) yet")
        self._rr_generated, self._rr_rows, self._rr_phase = None, None, "generation"
        try:
            out = super()._generate_and_score_completions(inputs)
            if self._rr_rows is None:  # no old-log-prob pass ran (on-policy settings)
                if self.routing_replay == "old_logprob":
                    raise ReplayError(
                        "routing_replay='old_logprob' found no old-log-prob pass for this generation to record "
                        "(TRL computes old log-probs only off-policy)"
                    )
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
                self._rr_rows = self._rollout_rows(ids, out["completion_ids"].shape[1])
            rows = self._rr_rows
        finally:
            self._rr_generated, self._rr_rows, self._rr_phase = None, None, None
        attended = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)  # TRL's loss forwards' mask
        out[INDICES], out[MASK] = rows.indices, attended_only(rows, attended).mask
        out[TOKENS] = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        return out

    def _rollout_rows(self, input_ids: torch.Tensor, logits_to_keep: int) -> Routes:
        if self._rr_generated is None:
            raise ReplayError("routing_replay='rollout' found no routes recorded while TRL generated")
        routes, prompt_ids, completion_ids = self._rr_generated
        partial = self.rollout_func is not None  # (an engine may leave a prompt's start unrecorded: it routes live)
        rows = routes_for_batch(
            routes, prompt_ids, completion_ids, input_ids, logits_to_keep, self.pad_to_multiple_of, partial=partial
        )
        self._rr_layers = rows.layers
        return rows.to(input_ids.device)

    # ---- log-prob passes ----------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(  # noqa: ANN202
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        **kw,  # noqa: ANN001, ANN003
    ):
        if self.routing_replay is None or self._rr_phase != "generation" or not self._is_policy(model):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, **kw
            )
        if self._rr_rows is not None:
            raise ReplayError(
                "a second policy log-prob pass over one generation: routing replay cannot tell them apart"
            )
        extra = sorted(k for k, v in kw.items() if v is not None and k not in ("compute_entropy", "compute_aux_loss"))
        if extra:
            raise ValueError(f"routing_replay does not support the model inputs {extra} (multimodal) yet")
        rollout = self.routing_replay == "rollout"
        rows = attended_only(self._rollout_rows(input_ids, logits_to_keep), attention_mask) if rollout else None
        size, core = batch_size or input_ids.shape[0], self._core(model)
        parts, recorded, moved = [], [], []
        for start in range(0, input_ids.shape[0], size):
            chunk = slice(start, start + size)
            ctx = replay_routes(core, rows[chunk], track_live=True) if rollout else record_routes(core)
            with ctx:
                parts.append(
                    super()._get_per_token_logps_and_entropies(
                        model, input_ids[chunk], attention_mask[chunk], logits_to_keep, None, **kw
                    )
                )
            if rollout:
                moved.append(ctx.live_moved())
            else:
                recorded.append(ctx.routes)
        if rollout:
            self._log_moved("routing/mismatch/fraction", moved, rows.top_k)
        else:
            rows = last_token_live(Routes.cat(recorded), attention_mask)
            self._rr_layers = rows.layers
        self._rr_rows = rows
        logps = torch.cat([p[0] for p in parts])
        entropies = torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None
        aux = torch.stack([p[2] for p in parts]).mean() if parts[0][2] is not None else None
        return logps, entropies, aux

    # ---- loss: the replay stays open through the backward ----------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch):  # noqa: ANN001, ANN201
        if self.routing_replay is None:
            return super().training_step(model, inputs, num_items_in_batch)
        self._rr_open = []
        with contextlib.ExitStack() as stack:
            self._rr_stack = stack
            try:
                out = super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._rr_stack = None
        self._log_moved("routing/routes_moved_since_rollout", [c.live_moved() for c in self._rr_open], self._top_k())
        self._rr_open = []
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
        if self.routing_replay is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._rr_layers is None or INDICES not in inputs:
            raise ReplayError(
                f"routing_replay={self.routing_replay!r} found no routes in this batch (no {INDICES!r} key): batches "
                "must come from this trainer's _prepare_inputs"
            )
        check_rows(inputs, INDICES, MASK, TOKENS)
        routes = Routes(inputs[INDICES], inputs[MASK], self._rr_layers)
        ctx = replay_routes(self._core(model), routes, track_live=True)
        if self._rr_stack is None:  # evaluation (prediction_step): no backward follows
            with ctx:
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self._log_moved("routing/routes_moved_since_rollout", [ctx.live_moved()], routes.top_k)
            return loss
        self._rr_stack.enter_context(ctx)
        self._rr_open.append(ctx)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _core(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.accelerator.unwrap_model(model)

    def _is_policy(self, model: torch.nn.Module) -> bool:
        """The trained policy, not the reference model (a separate one, or PEFT's adapter-disabled / "ref" one)."""
        core = self._core(model)
        if core is not self._core(self.model) or (self.ref_model is not None and model is self.ref_model):
            return False
        if getattr(core, "peft_config", None) is not None:
            from peft.tuners.tuners_utils import BaseTunerLayer

            if getattr(core, "active_adapter", None) == "ref":
                return False
            if any(m.disable_adapters for m in core.modules() if isinstance(m, BaseTunerLayer)):
                return False
        return True

    def _top_k(self) -> int:
        return self._rr_layers[0].top_k if self._rr_layers else 1

    def _log_moved(self, name: str, counts: list[tuple[torch.Tensor, torch.Tensor]], top_k: int) -> None:
        if not counts:
            return
        moved = sum(int(m.sum()) for m, _ in counts)
        compared = sum(int(c.sum()) for _, c in counts)
        total = self.accelerator.gather(torch.tensor([moved, compared * top_k], device=self.accelerator.device))
        moved, slots = total.view(-1, 2).sum(0).tolist()
        mode = "train" if self.model.training else "eval"
        if slots:
            self._metrics[mode][name].append(moved / slots)
        elif not self._rr_uncompared:  # (once per trainer)
            self._rr_uncompared = True
            warnings.warn(
                f"routing_replay: {name} is not logged: no replayed router call compared its live pick (group-limited "
                "routers, such as DeepSeek-V3's, and PhiMoE's sparsemixer are not compared); the replay itself runs",
                stacklevel=2,
            )


def attended_only(routes: Routes, attention_mask: torch.Tensor) -> Routes:
    """`routes` [B, T] without the positions `attention_mask` [B, T] leaves out (TRL's `mask_truncated_completions`
    zeroes a truncated row's completion): no loss reads them nor attends to them, so they route live, and the
    mismatch metrics do not count the routing that masking them changed.

    Example:
        >>> attended_only(routes, torch.cat([prompt_mask, completion_mask], 1))  # doctest: +SKIP
    """
    return Routes(routes.indices, routes.mask & attention_mask.to(routes.mask.device).bool(), routes.layers)


def last_token_live(routes: Routes, attention_mask: torch.Tensor) -> Routes:
    """`routes` [B, T] without each row's last attended position (its routing only shapes logits no loss reads),
    so that R2 replays the positions R3 does: from the first prompt token to the one before the last token."""
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)  # the last 1 of each row
    mask = routes.mask.clone()
    mask[torch.arange(mask.shape[0], device=mask.device), last.to(mask.device)] = False
    return Routes(routes.indices, mask, routes.layers)
