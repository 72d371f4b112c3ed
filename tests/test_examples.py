"""The examples run on CPU as a new user would run them, their rewrites happen, and their losses equal eager's."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILECOMPILE_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, str(ROOT / "examples" / name), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_quickstart_runs_on_cpu():
    out = run_example("quickstart.py")
    assert "fused_linear_ce=1  tiled_mlp=2" in out.stdout, out.stdout
    worst = float(out.stdout.split("largest grad difference")[1].split()[0])
    assert worst < 1e-5, out.stdout


def counts(stdout: str) -> dict[str, int]:
    """The report's counts line (``tensor_parallel=0  attention=4 ...``) as a dict."""
    line = next(x for x in stdout.splitlines() if x.strip().startswith("tensor_parallel="))
    return {k: int(v) for k, v in (item.split("=") for item in line.split())}


def assert_matches_eager(stdout: str) -> None:
    """``loss A (eager B), largest grad difference C``: A equals B to the printed digits, C is small."""
    line = next(x for x in stdout.splitlines() if x.startswith("loss ") and "(eager" in x)
    loss, eager = float(line.split()[1]), float(line.split("(eager")[1].split(")")[0])
    assert abs(loss - eager) <= 2e-6, line
    assert float(line.split("largest grad difference")[1].split()[0]) < 1e-5, line


@pytest.mark.parametrize("packed", ["0", "4"])
def test_grpo_step_runs_on_cpu(packed):
    """Compiled twice (no-grad old log-probs, then the loss): 2 layers' attention and MLPs, one lm_head each."""
    out = run_example("grpo_step.py", "--inner", "aot_eager", "--packed", packed)
    expected = dict(tensor_parallel=0, attention=4, fused_linear_ce=2, tiled_mlp=4, layer_regions=2)
    assert counts(out.stdout) == expected, out.stdout
    assert ("masked_attention" if packed != "0" else "is_causal=True") in out.stdout, out.stdout
    assert "log-prob, entropy" in out.stdout, out.stdout
    assert_matches_eager(out.stdout)
    assert "peak memory" in out.stdout


def test_sft_long_context_runs_on_cpu():
    """HF's own cross-entropy (labels=) is fused; the packed documents' mask becomes masked attention."""
    out = run_example("sft_long_context.py", "--inner", "aot_eager")
    expected = dict(tensor_parallel=0, attention=2, fused_linear_ce=1, tiled_mlp=2, layer_regions=2)
    assert counts(out.stdout) == expected, out.stdout
    assert "masked_attention" in out.stdout and "cross_entropy mean" in out.stdout, out.stdout
    assert_matches_eager(out.stdout)
    assert "peak memory" in out.stdout


def assert_steps_match(stdout: str) -> None:
    """``step k: loss A (eager B), grad norm C (eager D)`` for 3 steps, each equal to the printed digits."""
    steps = [x for x in stdout.splitlines() if x.startswith("step ")]
    assert len(steps) == 3, stdout
    for line in steps:
        parts = line.replace(",", "").replace("(", "").replace(")", "").split()
        loss, eloss, norm, enorm = float(parts[3]), float(parts[5]), float(parts[8]), float(parts[10])
        assert abs(loss - eloss) <= 2e-6 and abs(norm - enorm) <= 2e-5 * max(1.0, enorm), line


@pytest.mark.parametrize("name", ["hf_trainer_sft.py", "trl_grpo.py"])
def test_trainer_examples_run_on_cpu(name):
    """compile_trainer on HF's Trainer and TRL's GRPOTrainer: attention, the fused lm_head and the MLPs rewritten
    in every compiled graph; 3 logged steps equal the trainer without tilecompile."""
    for module in ("transformers", "datasets", "accelerate", *(("trl",) if name.startswith("trl") else ())):
        pytest.importorskip(module)  # optional test dependencies
    out = run_example(name, "--inner", "aot_eager")
    c = counts(out.stdout)
    assert c["fused_linear_ce"] >= 1 and c["attention"] == c["tiled_mlp"] == 2 * c["fused_linear_ce"], out.stdout
    assert_steps_match(out.stdout)
