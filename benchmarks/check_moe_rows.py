"""GPU check of the experts op with a row weight and rows past offsets[-1] (issue 42): the op's output and its
grads (x, the stacked gate_up, down, the row weight: the act_backward_weighted kernel's) against grouped_mm's with
autograd, bf16, on the acceptance shape's first 4,096 tokens, over chunks of 8,192 rows. Prints the largest relative
error of each and whether the tail rows' output and row-weight grad are zero.

usage: python benchmarks/check_moe_rows.py
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_moe_op import _grouped_mm, routed  # noqa: E402

from tilecompile.ops import tiled_grouped_mlp as grouped_op  # noqa: E402


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main() -> None:
    grouped_op.USE_ROWS_KERNEL = True  # the kernel, whatever its default
    x, gate_up, down, offsets, dy = routed(4096, 128, 2048, 768, 8, torch.device("cuda"))
    offsets = offsets.clone()
    offsets[-1] -= 100  # the last 100 rows belong to no expert: the op's output there is zero
    live = int(offsets[-1])
    # the op takes the weight in x's dtype, as HF casts it
    weight = torch.rand(x.shape[0], 1, device="cuda", dtype=x.dtype).requires_grad_()
    inputs = (x, gate_up, down, weight)
    g, u = _grouped_mm(x, gate_up.transpose(-2, -1), offsets).chunk(2, dim=-1)
    ref = _grouped_mm(torch.nn.functional.silu(g) * u, down.transpose(-2, -1), offsets) * weight
    ref_grads = torch.autograd.grad(ref[:live], inputs, dy[:live])
    ours = grouped_op.tiled_grouped_mlp(x, offsets, gate_up.transpose(-2, -1), None, down.transpose(-2, -1),
                                        chunk_tokens=8192, row_weight=weight)  # fmt: skip
    grads = torch.autograd.grad(ours, inputs, dy)
    print(f"rows_out check: max rel err {_err(ours[:live], ref[:live]):.2e}, tail rows zero: "
          f"{bool((ours[live:] == 0).all())}", flush=True)  # fmt: skip
    # grouped_mm leaves the rows past offsets[-1] undefined, its dx and the weight's grad there too: the live rows
    live_rows = (slice(None, live), slice(None), slice(None), slice(None, live))
    names = ("x", "gate_up", "down", "row_weight")
    errs = ", ".join(f"{name} {_err(a[r], b[r]):.2e}" for name, a, b, r in zip(names, grads, ref_grads, live_rows))
    print(f"weighted backward check: max rel err of the grads: {errs}; row-weight grad of the tail rows zero: "
          f"{bool((grads[3][live:] == 0).all())}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
