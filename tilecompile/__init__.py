"""tilecompile: a torch.compile backend that rewrites LLM training graphs to use far less memory.

``torch.compile(model, backend="tilecompile")`` needs no import of this package (it is registered through the
``torch_dynamo_backends`` entry point). Import it for ``report()``, ``reset()``, ``parallelize()`` and the fused ops.
"""

from tilecompile.integrations import ddp as _ddp
from tilecompile.integrations.loss_head import LossHead
from tilecompile.parallel import parallelize
from tilecompile.reporting import Report, report, reset

# torch.compile(backend="tilecompile") imports tilecompile.backend, so this package first: a compiled DDP module's
# graph then goes through the passes whole before DDP's bucket split (tilecompile/integrations/ddp.py)
_ddp.install()

__all__ = ["LossHead", "Report", "parallelize", "report", "reset"]
__version__ = "0.1.0"
