"""The importer tests' shared fixture: one recorded generation per test module (engine_payloads.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from engine_payloads import recorded_generation


@pytest.fixture(scope="module")
def generation() -> SimpleNamespace:
    return recorded_generation()
