"""Control plane: membership, leases, partition assignment and status endpoints of a job."""

from .assign import assign, capability_weight, quotas
from .client import Assignment, CoordinatorClient, Registration
from .errors import (AuthError, BadRequestError, ConflictError, CoordinatorError,
                     CoordinatorUnavailableError, FencedError, MemberGoneError, UnknownMemberError)
from .membership import Member, Membership, MemberState
from .settings import CoordinatorSettings
from .state import JobConfig, Store, check_fence

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
