"""The pack's one message prefix, ``[Precision LoRA] ``, added where a message leaves the pack.

The pure packages (attention, training, lora, probe) and the node code raise plain messages; the prefix is
added at the boundaries a message crosses on its way to the user:
- a pack node's ``execute`` and ``validate_inputs`` (``nodes.checks.gate``: every node passes through it);
- the pack's forwards that run inside other nodes (the LoRA layers' and the attention override's, under
  KSampler or another pack's node: ``boundary``);
- the pack's HTTP routes (``nodes.checks.file_names``);
- the pack's log records (``install_log_prefix``: every logger of the pack's modules).

``mark`` prefixes an exception raised by the pack's own code (the innermost frame of its traceback is in one of
the pack's product folders), once; an exception raised inside ComfyUI, torch or another pack passes unchanged
(an out-of-memory error too, wherever it happens).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

PREFIX = "[Precision LoRA] "
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRODUCT = tuple(os.path.join(ROOT, d) + os.sep for d in ("attention", "training", "lora", "probe", "data",
                                                         "nodes", "runner", "demo"))
PACKAGE = __name__.removesuffix(".nodes.host.errors")  # the pack's package as ComfyUI imported it


def prefixed(text: str) -> str:
    """``text`` with the prefix (once)."""
    return text if text.startswith(PREFIX) else PREFIX + text


def plain(text: str) -> str:
    """``text`` without the prefix (a message quoted inside another)."""
    return text.removeprefix(PREFIX)


def raised_by_pack(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback is a file of the pack's product folders."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(PRODUCT)


def mark(exc: BaseException) -> BaseException:
    """``exc`` with the prefix on its message when the pack raised it (one text argument); returned as is."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError) or not raised_by_pack(exc):
        return exc
    if len(exc.args) == 1 and isinstance(exc.args[0], str):  # one prefix, in front (a quoted pack message inside
        exc.args = (PREFIX + exc.args[0].replace(PREFIX, ""),)  # another, marked earlier, loses its own)
    return exc


@contextlib.contextmanager
def boundary() -> Iterator[None]:
    """The body's exceptions leave with the prefix (``mark``), traceback and type unchanged."""
    try:
        yield
    except Exception as exc:
        mark(exc)
        raise


class _Prefixed(logging.Filter):
    """Adds the prefix to each record of the pack's loggers (the message template, before formatting)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not record.msg.startswith(PREFIX):
            record.msg = PREFIX + record.msg
        return True


_FILTER = _Prefixed()


def install_log_prefix() -> int:
    """Every logger of the pack's modules (``logging.getLogger(__name__)`` under ``PACKAGE``) gets the prefix
    filter; returns how many loggers have it. Called when the pack registers and at each node's execution
    (a module first imported later has its logger by then)."""
    count = 0
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == PACKAGE or name.startswith(PACKAGE + ".")):
            if _FILTER not in logger.filters:
                logger.addFilter(_FILTER)
            count += 1
    return count
