"""The ditron log as the transformers tests read it on their ranks: every message at DEBUG, and
whether each collective a graph left has its line."""

from __future__ import annotations

import contextlib
import logging
import re

# a line per left collective no candidate holds: "graph <name>: <layer>] ... group=G not fused: why"
NOT_FUSED = re.compile(r"^graph \S+ \w+: .*\] .*group=\S+ not fused: ")


@contextlib.contextmanager
def captured():
    """The messages of the ditron logger, at DEBUG, while the block runs."""
    from ditron_inductor.log_names import LOGGER_NAME

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(LOGGER_NAME)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def reason(collective) -> str:
    """A left collective's reason, its node's name dropped."""
    return re.sub(r" \(\w+\)$", "", collective.reason)


def unexplained(reports, lines: list[str]) -> int:
    """The collectives left (no candidate holds them) less the log's lines for them."""
    left = sum(1 for r in reports for c in r.left if c.kind != "candidate")
    return left - sum(1 for line in lines if NOT_FUSED.search(line))
