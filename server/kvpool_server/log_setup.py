"""The server's logging: ``--log-format text`` (the default) or ``json`` (one object a line), at ``--log-level``."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence


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


def requested_log_format(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The --log-format asked for (flag, else KVPOOL_LOG_FORMAT), read before the settings are -- for a fatal
    error in reading them; "text" unless json was asked for."""
    value = environ.get("KVPOOL_LOG_FORMAT", "text")
    for i, arg in enumerate(argv):
        if arg == "--log-format" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--log-format="):
            value = arg.partition("=")[2]
    return "json" if value.strip().lower() == "json" else "text"


def fatal_line(message: str, log_format: str) -> str:
    """A fatal start-up error as the logs write it: ``kvpool-server: ...`` (text) or one JSON object (json)."""
    if log_format != "json":
        return f"kvpool-server: {message}"
    record = logging.LogRecord("kvpool_server", logging.CRITICAL, __file__, 0, message, None, None)
    return JsonLogFormatter().format(record)


def configure_logging(log_level: str, log_format: str) -> None:
    """The root logger at ``log_level`` (--log-level), as text or JSON lines (--log-format)."""
    level = log_level.upper()
    if log_format == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonLogFormatter())
        logging.basicConfig(level=level, handlers=[handler], force=True)
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
