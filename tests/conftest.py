"""Test setup: seeds, strict mode, GPU skips, hypothesis profiles (TILECOMPILE_FUZZ=ci|long)."""

from __future__ import annotations

import os
import pathlib
import random
import sys

import pytest
import torch

# `python -m pytest` puts the working directory first on sys.path. Run from the repository root, the project's
# top-level kernels/ folder (installed as tilecompile.kernels) would then shadow PyPI's `kernels` package, which
# transformers >= 5.25 imports. tilecompile is installed (editable), so the root is not needed on the path.
_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _ROOT]

# The suite runs strict: a pass that fails raises instead of being undone with a warning.
os.environ.setdefault("TILECOMPILE_STRICT", "1")

try:
    from hypothesis import HealthCheck, settings

    _common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **_common)
    settings.register_profile("long", max_examples=10_000, print_blob=True, **_common)
    settings.load_profile(os.environ.get("TILECOMPILE_FUZZ", "ci"))
except ImportError:  # hypothesis is a test extra; fuzz tests skip without it
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_reset():
    random.seed(0)
    torch.manual_seed(0)
    import tilecompile

    tilecompile.reset()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
