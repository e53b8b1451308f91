"""Structured logs with stable keys (event, agent_id, room_id, turn_id, subject).

``log.info("turn replied", agent_id=..., turn_id=...)`` writes one line: JSON
when ``PARLEY_LOG_FORMAT=json``, otherwise ``key=value`` text for people.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_RESERVED = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "event": record.getMessage(),
            "logger": record.name,
        }
        line.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class _TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        fields = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _RESERVED)
        line = f"{ts} {record.levelname:<5} {self.service} {record.getMessage()}"
        if fields:
            line += " " + fields
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(service: str, *, level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(service) if fmt == "json" else _TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("nats", "grpc", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Logger:
    """A thin wrapper that turns keyword arguments into structured fields."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def _emit(self, level: int, event: str, exc_info: bool, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, event, extra=fields, exc_info=exc_info, stacklevel=3)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, False, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, False, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, False, fields)

    def error(self, event: str, *, exc_info: bool = False, **fields: Any) -> None:
        self._emit(logging.ERROR, event, exc_info, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, True, fields)


def get_logger(name: str) -> Logger:
    return Logger(name)
