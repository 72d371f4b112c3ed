"""The library releases the passes are tested against, and one warning for a release outside them.

The passes read Hugging Face transformers' model code by what it computes, and that code changes between releases
(4.57 slices the mask to the key length, 5.17 masks the experts' rows with a sentinel, 5.25 wraps attention in the
`kernels` package). CI's compatibility stage (``.ci/compat``) runs the release matrix at the range's floor, at
verl 0.9's pin, at the GPU image's release and at the newest; pyproject's test extra states the same range.

Why the floor is 5.3: below it the MoE experts cannot be compiled whole, so they cannot be tiled (the dense
families' rewrites do fire on 4.57.6). 4.57's experts are a Python loop over the experts that were hit, found with
``nonzero`` (a data-dependent shape: Dynamo breaks the graph there). 5.0 to 5.2 call ``torch._grouped_mm`` on
fp32 rows on the CPU, which fake tensors refuse ("Expected inputs of BF16 type"), so the compile fails with or
without tilecompile; 5.3 brought the fallback op that CPU and fp32 take. Measured 2026-12-04, torch 2.13 CPU.
"""

from __future__ import annotations

import re
import sys
import warnings

# (oldest supported, newest tested): releases in between are supported; pyproject's test extra says the same
TRANSFORMERS = ("5.3.0", "5.25.0")
_warned: set[str] = set()


def _key(version: str) -> tuple[int, int, int]:
    parts = [int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def transformers_supported(version: str) -> bool:
    """``version`` lies in the supported range (the newest tested release's patch releases included)."""
    low, high = TRANSFORMERS
    return _key(low) <= _key(version) and _key(version)[:2] <= _key(high)[:2]


def check_transformers() -> None:
    """One warning per process if the imported transformers is outside the supported range (nothing if it is not
    imported: then the passes do not read its code)."""
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", None)
    if not isinstance(version, str) or version in _warned or transformers_supported(version):
        return
    _warned.add(version)
    low, high = TRANSFORMERS
    side = "older than the oldest supported" if _key(version) < _key(low) else "newer than the newest tested"
    warnings.warn(
        f"tilecompile: transformers {version} is {side} release (supported: {low} to {high}): the passes may not "
        "recognise its model code; check tilecompile.report() for the attention, lm_head and MLP rewrites",
        stacklevel=3,
    )
