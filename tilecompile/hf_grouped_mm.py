"""Hugging Face's grouped_mm experts under torch.compile, in the releases where they leave the graph.

1. The fallback op before transformers 5.24: give its backward an opaque op, so that a step whose experts are left
untiled compiles as one graph.

transformers >= 5.3 runs MoE experts through ``transformers::grouped_mm_fallback`` (a custom op: a loop over
``offs.tolist()``) where torch's own grouped_mm cannot be used (the CPU, fp32 or fp32-autocast weights, a GPU other
than sm_90). Up to 5.23 the op's registered backward is Python that calls ``offs.tolist()`` itself. AOTAutograd
traces that backward with fake tensors while it builds the joint graph, and ``tolist`` of a fake tensor raises
``DataDependentOutputException``: the inner compile fails, Dynamo retries the frame in smaller pieces, and the
experts run eagerly (on CPU, 23 of 29 inner compiles of a 2-layer Qwen3-MoE step raised). That happens whenever the
experts stay untiled with gradients on (``mlp_experts=0``, fewer routed rows than ``mlp_min_tokens``, a skip).

transformers 5.24 made the backward a custom op of its own (``transformers::grouped_mm_fallback_backward``).
``install()`` does the same for the older releases: it registers ``tilecompile::grouped_mm_fallback_backward``
(the same loop: for each expert's rows, ``dx = dy W[e]ᵀ`` and ``dW[e] = xᵀ dy``, in the same order with the same
``torch.mm`` calls, so eager results are bit-identical) and makes it the fallback op's backward. Releases that
already have the backward op, or whose op has another schema, are left as they are.

2. The version probe's debug line (transformers 5.3 to 5.10). Each experts call asks ``_can_use_grouped_mm``, which
calls ``is_torch_less_or_equal`` (an ``lru_cache``d function: Dynamo traces the function itself, not the cache),
which logs ``logger.debug("Detected torch version ...")`` from ``transformers.utils.import_utils``. Dynamo cannot
trace a logger call and breaks the graph in every MoE layer (bf16 weights: the path that reaches the probe), so the
experts are never in a graph with their routing and nothing is tiled. ``quiet_version_probe()`` adds that one
logger's ``debug`` (not ``logging.Logger.debug``, not any other logger) to Dynamo's
``ignore_logging_functions``: in compiled code that debug line is not written; nothing else changes.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import Tensor

log = logging.getLogger("tilecompile")
_SCHEMA = "(Tensor input, Tensor weight, Tensor offs) -> Tensor"
_installed = False


@torch.library.custom_op("tilecompile::grouped_mm_fallback_backward", mutates_args=())
def grouped_mm_fallback_backward(
    grad_output: Tensor, input: Tensor, weight: Tensor, offs: Tensor
) -> tuple[Tensor, Tensor]:  # noqa: E501
    grad_input = torch.zeros_like(input)
    grad_weight = torch.zeros_like(weight)
    start = 0
    for i, end in enumerate(offs.tolist()):  # one host sync, as the forward op's own
        if start == end:
            continue
        torch.mm(grad_output[start:end], weight[i].T, out=grad_input[start:end])
        torch.mm(input[start:end].T, grad_output[start:end], out=grad_weight[i])
        start = end
    return grad_input, grad_weight


@grouped_mm_fallback_backward.register_fake
def _(grad_output, input, weight, offs):
    return torch.empty_like(input), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_output):
    input, weight, offs = ctx.saved_tensors
    grad_input, grad_weight = grouped_mm_fallback_backward(grad_output, input, weight, offs)
    return grad_input, grad_weight, None


def quiet_version_probe() -> bool:
    """Dynamo ignores ``transformers.utils.import_utils.logger.debug`` (see the module docstring); True if added."""
    module = sys.modules.get("transformers.utils.import_utils")
    logger = getattr(module, "logger", None)
    if not isinstance(logger, logging.Logger):
        return False
    ignored = torch._dynamo.config.ignore_logging_functions
    if logger.debug not in ignored:
        ignored.add(logger.debug)
    return True


def install() -> bool:
    """``quiet_version_probe()``, then give transformers' fallback op the opaque backward where its release lacks
    one; True if it has one now."""
    global _installed
    if _installed:
        return True
    if "transformers" not in sys.modules:
        return False
    quiet_version_probe()
    namespace = torch.ops.transformers
    if not hasattr(namespace, "grouped_mm_fallback"):
        return False
    if hasattr(namespace, "grouped_mm_fallback_backward"):  # transformers >= 5.24 has its own
        _installed = True
        return True
    schema = str(namespace.grouped_mm_fallback.default._schema)
    if schema.split("(", 1)[-1] != _SCHEMA.split("(", 1)[-1]:
        log.info("transformers::grouped_mm_fallback has another schema (%s); its backward is left as it is", schema)
        return False
    torch.library.register_autograd("transformers::grouped_mm_fallback", _backward, setup_context=_setup_context)
    _installed = True
    return True
