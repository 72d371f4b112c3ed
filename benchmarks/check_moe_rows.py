"""GPU check of the experts op's forward with a row weight and rows past offsets[-1] (issue 42): the op's output
against grouped_mm's, bf16, on the acceptance shape's first 4,096 tokens. Prints the largest relative error and
whether the tail rows are zero.

usage: python benchmarks/check_moe_rows.py
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_moe_op import _grouped_mm, routed  # noqa: E402

from tilecompile.ops import tiled_grouped_mlp as grouped_op  # noqa: E402


def main() -> None:
    grouped_op.USE_ROWS_KERNEL = True  # the kernel, whatever its default
    x, gate_up, down, offsets, _ = routed(4096, 128, 2048, 768, 8, torch.device("cuda"))
    x = x.detach()
    offsets = offsets.clone()
    offsets[-1] -= 100  # the last 100 rows belong to no expert: the op's output there is zero
    weight = torch.rand(x.shape[0], 1, device="cuda", dtype=x.dtype)  # the op takes it in x's dtype, as HF casts it
    w = gate_up.detach().transpose(-2, -1)
    g, u = _grouped_mm(x, w, offsets).chunk(2, dim=-1)
    ref = (_grouped_mm(torch.nn.functional.silu(g) * u, down.detach().transpose(-2, -1), offsets) * weight).bfloat16()
    ours = grouped_op.tiled_grouped_mlp(x, offsets, w[..., :768], w[..., 768:], down.detach().transpose(-2, -1),
                                        chunk_tokens=8192, row_weight=weight)  # fmt: skip
    live = int(offsets[-1])
    err = ((ours[:live].float() - ref[:live].float()).abs().max() / ref[:live].float().abs().max()).item()
    print(f"rows_out check: max rel err {err:.2e}, tail rows zero: {bool((ours[live:] == 0).all())}", flush=True)


if __name__ == "__main__":
    main()
