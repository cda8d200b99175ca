"""The parameter plane: versioned parameter shards in Redis, the update log, parameter servers.

Trainers use :class:`ParameterStore` (``init_model``, ``pull``),
:func:`wait_for_clock` and :class:`Pusher` (or :func:`push_update` with an
:class:`Update`); ``streamtrain ps`` runs :class:`ParameterServer`. See
``docs/parameter-plane.md`` for the Redis data model and the protocol, and
:mod:`services.protocol` and :mod:`services.scripts` for its wire contract.

Each public name is imported from its module on first use (:func:`common.exports.lazy_exports`):
importing a light module (``services.clocks``, ``services.errors``) does not import redis, torch
or prometheus-client.
"""

from typing import TYPE_CHECKING

from common.exports import lazy_exports

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
    "Prepared",
    "Feedback",
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

lazy_exports(__name__, __all__, {
    ".snapshot.checkpoint": ("restore_checkpoint", "save_checkpoint"),
    ".codecs": ("CodecChain", "Sent", "decode_gradient", "decode_sent", "get_codec"),
    ".clocks": ("ClockWait", "JobClocks"),
    ".consistency": ("Consistency", "StalenessTimeout", "read_job_clocks", "starting_clock", "wait_for_clock"),
    ".push.encoder": ("Feedback", "Prepared", "Pusher", "PushResult"),
    ".errors": ("BackpressureError", "BadGradientError", "CheckpointError", "FencedError", "LayoutError",
                "OffsetConflictError", "ParameterPlaneError", "PayloadError", "UnknownCodecError"),
    ".layout": ("Layout", "ShardSpec", "TensorSpec"),
    ".optim": ("OPTIMIZERS", "OptimizerConfig"),
    ".server.service": ("ParameterServer", "ServerStatus"),
    ".settings": ("ServerSettings",),
    ".store": ("ModelMeta", "ParameterStore", "Snapshot", "connect"),
    ".protocol": ("Update",),
    ".push.updates": ("committed_offsets", "push_update", "unapplied_updates", "was_committed"),
})

if TYPE_CHECKING:  # the same names, eagerly, for type checkers (tests/test_structure.py keeps the two alike)
    from .clocks import ClockWait, JobClocks
    from .codecs import CodecChain, Sent, decode_gradient, decode_sent, get_codec
    from .consistency import Consistency, StalenessTimeout, read_job_clocks, starting_clock, wait_for_clock
    from .errors import (
        BackpressureError,
        BadGradientError,
        CheckpointError,
        FencedError,
        LayoutError,
        OffsetConflictError,
        ParameterPlaneError,
        PayloadError,
        UnknownCodecError,
    )
    from .layout import Layout, ShardSpec, TensorSpec
    from .optim import OPTIMIZERS, OptimizerConfig
    from .protocol import Update
    from .push.encoder import Feedback, Prepared, Pusher, PushResult
    from .push.updates import committed_offsets, push_update, unapplied_updates, was_committed
    from .server.service import ParameterServer, ServerStatus
    from .settings import ServerSettings
    from .snapshot.checkpoint import restore_checkpoint, save_checkpoint
    from .store import ModelMeta, ParameterStore, Snapshot, connect
