"""Structured logs on stderr: `--log-format json|text`, quiet by default (level warning).

One line per RPC at level info (method, status, duration_ms, request_id; 5xx at warning, 500 at
error), so the default level logs only failures. Secrets registered with `add_secret` (the bearer
token) and any `Bearer <credential>` are redacted from every line, whatever logger wrote it.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "color_message"}
# RFC 6750 b64token after "Bearer " (but not the phrase "bearer token" in our own messages).
_BEARER = re.compile(r"(?i)\b(bearer\s+)(?!token\b)[A-Za-z0-9\-._~+/]+=*")
_SECRETS: list[str] = []
REDACTED = "[redacted]"
LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_secret(secret: str) -> None:
    """Never print this string (nor its JSON-escaped form) in a log line."""
    for s in (secret, json.dumps(secret)[1:-1]):
        if s and s not in _SECRETS:
            _SECRETS.append(s)
    _SECRETS.sort(key=len, reverse=True)


def redact(line: str) -> str:
    for s in _SECRETS:
        line = line.replace(s, REDACTED)
    return _BEARER.sub(r"\1" + REDACTED, line)


def _extra(record: logging.LogRecord) -> dict:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extra(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return redact(json.dumps(out, default=str))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in _extra(record).items())
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        line = f"{ts} {record.levelname.lower()} {record.name}: {record.getMessage()}" + (f" {extra}" if extra else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


def configure_logging(level: str = "warning", fmt: str = "text") -> None:
    """Route everything (our loggers, uvicorn's) through one stderr handler in the chosen format."""
    from uvicorn.logging import TRACE_LOG_LEVEL

    logging.addLevelName(TRACE_LOG_LEVEL, "TRACE")  # uvicorn only names it when its own config runs

    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
