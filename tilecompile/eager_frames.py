"""Functions tilecompile compiled that Dynamo stopped compiling: they run eagerly, and the report says so.

Each compile of a frame adds an entry to its code's cache; a frame whose guards keep failing (a Python int that
changes every step, such as a packed token count a per-row loop reads) recompiles until Dynamo's
``recompile_limit`` (8 by default), and from then on runs eagerly, with no rewrite. Dynamo only logs a warning on
``torch._dynamo.convert_frame``'s logger. ``install()`` adds a handler there that turns that warning, for a function
this backend compiled before (``compiled_here``), into a report entry: the function, the limit, the last guard that
failed.
"""

from __future__ import annotations

import logging
import threading

from tilecompile import reporting

_LOGGER = "torch._dynamo.convert_frame"
_PREFIX = "torch._dynamo hit config."
_ours: set[str] = set()
_lock = threading.Lock()


def _describe(code) -> str:
    # Dynamo's own spelling of the function in its warning (convert_frame's format_func_info)
    return f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})"


def compiled_here() -> None:
    """Called from the backend: the frame Dynamo is compiling now is one of tilecompile's."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - outside a Dynamo trace (a graph compiled by hand): nothing to note
        return
    code = getattr(tx, "f_code", None)
    if code is not None:
        with _lock:
            _ours.add(_describe(code))


class _Handler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith(_PREFIX) or not isinstance(record.args, tuple) or len(record.args) < 4:
            return
        limit_type, limit, function, last_reason = record.args[:4]
        with _lock:
            if str(function) not in _ours:
                return
        reporting.eager_frame(
            reporting.EagerFrame(
                str(function), f"{limit_type}={limit}", " ".join(str(last_reason).split("\n")[0].split())
            )
        )


_handler: _Handler | None = None


def install() -> None:
    global _handler
    if _handler is None:
        _handler = _Handler(level=logging.WARNING)
        logging.getLogger(_LOGGER).addHandler(_handler)
