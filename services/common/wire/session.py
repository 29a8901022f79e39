"""A request's session: the conversation or agent loop it belongs to, named by the client.

Declared here once: the HTTP headers that carry a session (kvmesh's own, and those the common
coding agents send), how long a session id may be, and the one parser each boundary calls (the
frontend for headers and body, the router for the gRPC field).
"""

from __future__ import annotations

from collections.abc import Mapping

# Checked in this order after the body's ``kvmesh.session``: kvmesh's header (OpenCode sends it too),
# then NVIDIA Dynamo's, Claude Code's and Codex's. The body's ``user`` comes last.
SESSION_HEADERS = ("x-session-id", "x-dynamo-session-id", "x-claude-code-session-id", "session-id")
MAX_SESSION_ID_LENGTH = 256


def parse_session(text: str) -> str:
    """A session id as the router keeps it (empty: none); ValueError says what is wrong with it."""
    if len(text) > MAX_SESSION_ID_LENGTH:
        raise ValueError(f"a session id is at most {MAX_SESSION_ID_LENGTH} characters, not {len(text)}")
    if text and not text.isprintable():
        raise ValueError("a session id must be printable text")
    return text


def session_of(explicit: str | None, headers: Mapping[str, str], user: str | None) -> str:
    """The request's session: the body's ``kvmesh.session``, else the first session header present,
    else the body's ``user`` (empty: none). Raises ValueError naming where a bad one came from."""
    for source, value in (("kvmesh.session", explicit), *((h, headers.get(h)) for h in SESSION_HEADERS)):
        if value:
            try:
                return parse_session(value)
            except ValueError as exc:
                raise ValueError(f"{source}: {exc}") from None
    try:
        return parse_session(user or "")
    except ValueError as exc:
        raise ValueError(f"user: {exc}") from None
