"""Integrations with other engines; each is imported lazily, so its dependency stays optional.

Example:
    >>> from moe_replay.integrations.megatron import record_routes, replay_routes  # doctest: +SKIP
"""
