"""Control plane: membership, leases, partition assignment and status endpoints of a job.

Each public name is imported from its module on first use (:func:`common.exports.lazy_exports`):
importing a light module (``coordinator.assignment``, ``coordinator.membership``) does not
import aiohttp or redis.
"""

from typing import TYPE_CHECKING

from common.exports import lazy_exports

__all__ = [
    # assignment
    "assign",
    "capability_weight",
    "quotas",
    # client
    "CoordinatorClient",
    "Registration",
    "Assignment",
    # state
    "CoordinatorSettings",
    "JobConfig",
    "Member",
    "MemberState",
    "Membership",
    "Store",
    "check_fence",
    # errors
    "CoordinatorError",
    "AuthError",
    "BadRequestError",
    "ConflictError",
    "CoordinatorUnavailableError",
    "FencedError",
    "MemberGoneError",
    "UnknownMemberError",
]

lazy_exports(__name__, __all__, {
    ".assign": ("assign", "capability_weight", "quotas"),
    ".assignment": ("Assignment", "JobConfig", "Registration"),
    ".client": ("CoordinatorClient",),
    ".errors": ("AuthError", "BadRequestError", "ConflictError", "CoordinatorError",
                "CoordinatorUnavailableError", "FencedError", "MemberGoneError", "UnknownMemberError"),
    ".membership": ("Member", "Membership", "MemberState"),
    ".settings": ("CoordinatorSettings",),
    ".state": ("Store", "check_fence"),
})

if TYPE_CHECKING:  # the same names, eagerly, for type checkers (tests/test_structure.py keeps the two alike)
    from .assign import assign, capability_weight, quotas
    from .assignment import Assignment, JobConfig, Registration
    from .client import CoordinatorClient
    from .errors import (
        AuthError,
        BadRequestError,
        ConflictError,
        CoordinatorError,
        CoordinatorUnavailableError,
        FencedError,
        MemberGoneError,
        UnknownMemberError,
    )
    from .membership import Member, Membership, MemberState
    from .settings import CoordinatorSettings
    from .state import Store, check_fence
