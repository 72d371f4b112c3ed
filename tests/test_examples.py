"""The quickstart runs on CPU as a new user would run it, and its rewrites happen."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_runs_on_cpu():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILECOMPILE_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True, env=env, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fused_linear_ce=1  tiled_mlp=2" in out.stdout, out.stdout
    worst = float(out.stdout.split("largest grad difference")[1].split()[0])
    assert worst < 1e-5, out.stdout
