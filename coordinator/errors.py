"""Errors of the control plane. Each says whether retrying the same call can help."""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base class of control-plane errors."""

    retriable: bool = False
    """Whether repeating the same call may succeed."""


class UnknownMemberError(CoordinatorError):
    """The member id was never registered with this job (HTTP 404)."""


class MemberGoneError(CoordinatorError):
    """The member left or its lease expired; it must register anew (HTTP 410)."""


class FencedError(CoordinatorError):
    """A write carried a stale generation or partitions the member does not own.

    The member re-syncs by heartbeat (new generation and partitions) and may
    retry for partitions it still owns.
    """

    retriable = True


class ConflictError(CoordinatorError):
    """A compare-and-set on the membership state kept losing to concurrent writers."""

    retriable = True


class AuthError(CoordinatorError):
    """The bearer token is missing or wrong (HTTP 401)."""


class BadRequestError(CoordinatorError):
    """The coordinator refused the request as malformed (HTTP 400); the message names why."""


class CoordinatorUnavailableError(CoordinatorError):
    """The coordinator could not be reached or failed (connection error, HTTP 5xx)."""

    retriable = True
