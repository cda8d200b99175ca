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

lazy_exports(__name__)

if TYPE_CHECKING:  # the public names, each from its module: lazy_exports reads them here (common.exports)
    from .clocks import ClockWait as ClockWait
    from .clocks import JobClocks as JobClocks
    from .codecs import CodecChain as CodecChain
    from .codecs import Sent as Sent
    from .codecs import decode_gradient as decode_gradient
    from .codecs import decode_sent as decode_sent
    from .codecs import get_codec as get_codec
    from .consistency import Consistency as Consistency
    from .consistency import StalenessTimeout as StalenessTimeout
    from .consistency import read_job_clocks as read_job_clocks
    from .consistency import starting_clock as starting_clock
    from .consistency import wait_for_clock as wait_for_clock
    from .errors import BackpressureError as BackpressureError
    from .errors import BadGradientError as BadGradientError
    from .errors import CheckpointError as CheckpointError
    from .errors import FencedError as FencedError
    from .errors import LayoutError as LayoutError
    from .errors import NoModelError as NoModelError
    from .errors import OffsetConflictError as OffsetConflictError
    from .errors import ParameterPlaneError as ParameterPlaneError
    from .errors import PayloadError as PayloadError
    from .errors import UnknownCodecError as UnknownCodecError
    from .layout import Layout as Layout
    from .layout import ShardSpec as ShardSpec
    from .layout import TensorSpec as TensorSpec
    from .names import OPTIMIZERS as OPTIMIZERS
    from .optim import OptimizerConfig as OptimizerConfig
    from .protocol import Update as Update
    from .push.encoder import Feedback as Feedback
    from .push.encoder import Prepared as Prepared
    from .push.encoder import Pusher as Pusher
    from .push.encoder import PushResult as PushResult
    from .push.updates import committed_offsets as committed_offsets
    from .push.updates import push_update as push_update
    from .push.updates import unapplied_updates as unapplied_updates
    from .push.updates import was_committed as was_committed
    from .server.service import ParameterServer as ParameterServer
    from .server.service import ServerStatus as ServerStatus
    from .settings import ServerSettings as ServerSettings
    from .snapshot.checkpoint import restore_checkpoint as restore_checkpoint
    from .snapshot.checkpoint import save_checkpoint as save_checkpoint
    from .store import ModelMeta as ModelMeta
    from .store import ParameterStore as ParameterStore
    from .store import Snapshot as Snapshot
    from .store import connect as connect
