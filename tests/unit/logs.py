"""Capturing one logger's records in a test, whatever the logging setup around it.

`captured(name)` hangs its own handler on the named logger (and lowers its level to
DEBUG meanwhile), so it sees the records even when the ``jaxengine`` logger does not
propagate to the root (`server.api_server.launch.setup_logging`), where pytest's ``caplog`` looks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class Records(logging.Handler):
    """The records a logger emitted, in order."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@contextlib.contextmanager
def captured(name: str) -> Iterator[Records]:
    logger = logging.getLogger(name)
    records, level = Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
