"""Control plane: membership, leases, partition assignment and status endpoints of a job.

Each public name is imported from its module on first use (:func:`common.exports.lazy_exports`):
importing a light module (``coordinator.assignment``, ``coordinator.membership``) does not
import aiohttp or redis.
"""

from typing import TYPE_CHECKING

from common.exports import lazy_exports

lazy_exports(__name__)

if TYPE_CHECKING:  # the public names, each from its module: lazy_exports reads them here (common.exports)
    from .assign import assign as assign
    from .assign import capability_weight as capability_weight
    from .assign import quotas as quotas
    from .assignment import Assignment as Assignment
    from .assignment import JobConfig as JobConfig
    from .assignment import Registration as Registration
    from .client import CoordinatorClient as CoordinatorClient
    from .errors import AuthError as AuthError
    from .errors import BadRequestError as BadRequestError
    from .errors import ConflictError as ConflictError
    from .errors import CoordinatorError as CoordinatorError
    from .errors import CoordinatorUnavailableError as CoordinatorUnavailableError
    from .errors import FencedError as FencedError
    from .errors import MemberGoneError as MemberGoneError
    from .errors import UnknownMemberError as UnknownMemberError
    from .membership import Member as Member
    from .membership import Membership as Membership
    from .membership import MemberState as MemberState
    from .settings import CoordinatorSettings as CoordinatorSettings
    from .state import Store as Store
