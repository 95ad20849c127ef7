"""Routing Replay inside TRL's `GRPOTrainer`: `RoutingReplayGRPOTrainer(..., routing_replay="rollout")`.

Needs the `[trl]` extra (`pip install "moe-replay[trl]"`). The trainer overrides private `GRPOTrainer` methods, so
importing it checks that the installed TRL is in the tested range and raises ImportError, naming both, if not
(set `MOE_REPLAY_TRL_UNTESTED=1` to try another version at your own risk).
"""

from __future__ import annotations

import os

TESTED_TRL = (">=1.16.0", "<1.17")


def _check_trl() -> None:
    try:
        import trl
    except ImportError as e:
        raise ImportError('moe_replay.integrations.trl needs TRL: pip install "moe-replay[trl]"') from e
    from packaging.version import Version

    installed = Version(trl.__version__)
    if not Version(TESTED_TRL[0][2:]) <= installed < Version(TESTED_TRL[1][1:]):
        message = (
            f"moe_replay.integrations.trl is tested with trl{','.join(TESTED_TRL)} but trl {trl.__version__} is "
            'installed: pip install "moe-replay[trl]", or set MOE_REPLAY_TRL_UNTESTED=1 to try it anyway'
        )
        if os.environ.get("MOE_REPLAY_TRL_UNTESTED") != "1":
            raise ImportError(message)
        import warnings

        warnings.warn(message, stacklevel=2)


_check_trl()

from .layout import check_tokens, recorded_span, routes_for_batch  # noqa: E402
from .trainer import RoutingReplayGRPOTrainer  # noqa: E402
from .vllm_rollout import vllm_rollout  # noqa: E402

__all__ = ["RoutingReplayGRPOTrainer", "check_tokens", "recorded_span", "routes_for_batch", "vllm_rollout"]
