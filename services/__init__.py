"""The parameter plane: versioned parameter shards in Redis, the update log, parameter servers.

Trainers use :class:`ParameterStore` (``init_model``, ``pull``),
:func:`wait_for_clock` and :class:`Pusher` (or :func:`push_update` with an
:class:`Update`); ``streamtrain ps`` runs :class:`ParameterServer`. See
``docs/parameter-plane.md`` for the Redis data model and the protocol, and
:mod:`services.protocol` and :mod:`services.scripts` for its wire contract.
"""

from .checkpoint import CheckpointError, restore_checkpoint, save_checkpoint
from .codecs import CodecChain, Sent, decode_gradient, decode_sent, get_codec
from .consistency import (
    ClockWait, Consistency, JobClocks, StalenessTimeout, read_job_clocks, starting_clock, wait_for_clock,
)
from .encoder import Pusher, PushResult
from .errors import (
    BackpressureError, BadGradientError, FencedError, LayoutError, OffsetConflictError,
    ParameterPlaneError, PayloadError, UnknownCodecError,
)
from .layout import Layout, ShardSpec, TensorSpec
from .optim import OPTIMIZERS, OptimizerConfig
from .server import ParameterServer, ServerStatus
from .settings import ServerSettings
from .store import ModelMeta, ParameterStore, Snapshot, connect
from .protocol import Update
from .updates import committed_offsets, push_update, unapplied_updates, was_committed

__all__ = [
    # store and snapshots
    "ParameterStore",
    "Snapshot",
    "ModelMeta",
    "Layout",
    "TensorSpec",
    "ShardSpec",
    "OptimizerConfig",
    "OPTIMIZERS",
    "connect",
    # pushing
    "Update",
    "push_update",
    "was_committed",
    "unapplied_updates",
    "committed_offsets",
    "Pusher",
    "PushResult",
    # consistency
    "Consistency",
    "ClockWait",
    "wait_for_clock",
    "starting_clock",
    "JobClocks",
    "read_job_clocks",
    # codecs
    "get_codec",
    "decode_gradient",
    "decode_sent",
    "Sent",
    "CodecChain",
    # server
    "ParameterServer",
    "ServerSettings",
    "ServerStatus",
    # checkpoints
    "save_checkpoint",
    "restore_checkpoint",
    # errors
    "ParameterPlaneError",
    "FencedError",
    "OffsetConflictError",
    "BadGradientError",
    "UnknownCodecError",
    "PayloadError",
    "LayoutError",
    "BackpressureError",
    "StalenessTimeout",
    "CheckpointError",
]
