"""Service addresses as they may be shown: never with their credentials."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

__all__ = ["redact_url"]


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for logs and messages.

    ``redis://:secret@host:6379/0`` becomes ``redis://:***@host:6379/0``; a URL
    without a password is returned unchanged.
    """
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
