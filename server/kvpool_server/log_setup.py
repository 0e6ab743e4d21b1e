"""The server's logging: ``--log-format text`` (the default) or ``json`` (one object a line), at ``--log-level``."""

from __future__ import annotations

import json
import logging
import time


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: ts (ISO 8601, UTC), level, logger, msg, and exc when there is a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


JsonLogFormatter.converter = time.gmtime


def configure_logging(log_level: str, log_format: str) -> None:
    """The root logger at ``log_level`` (--log-level), as text or JSON lines (--log-format)."""
    level = log_level.upper()
    if log_format == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonLogFormatter())
        logging.basicConfig(level=level, handlers=[handler], force=True)
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
