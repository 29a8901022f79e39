"""structlog set-up shared by every service: JSON in production, console in a terminal.

Every log line of a request carries its ``request_id`` through structlog's context variables
(``structlog.contextvars.bound_contextvars(request_id=...)``).
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", json_logs: bool | None = None, service: str | None = None) -> None:
    """Configure structlog and the standard library logger once per process.

    ``json_logs=None`` picks console output when stderr is a terminal and JSON otherwise.
    """
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    numeric_level = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False)
    )
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    if service:
        processors.append(_add_service(service))
    processors += [structlog.processors.format_exc_info, renderer]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric_level, logging.WARNING), stream=sys.stderr)


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of writing (it may be replaced after
    configuration, as test runners and daemonising wrappers do)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _add_service(service: str) -> structlog.typing.Processor:
    def processor(_logger: object, _name: str, event_dict: dict) -> dict:
        event_dict.setdefault("service", service)
        return event_dict

    return processor
