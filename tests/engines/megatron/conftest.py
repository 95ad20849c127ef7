"""The megatron-core tests' shared fixture (the shims and the tiny model are in megatron_utils.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import free_port
from megatron_utils import megatron_cpu


@pytest.fixture(scope="module")
def megatron_process() -> Iterator[None]:
    """megatron-core's parallel state on CPU (one gloo rank) for a whole test module, which opts in with
    `pytestmark = pytest.mark.usefixtures("megatron_process")`."""
    with megatron_cpu(port=free_port()):
        yield
