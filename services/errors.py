"""One error hierarchy for the parameter plane.

Every error says whether retrying the same call can succeed (``retriable``),
like aiokafka's errors: a fenced trainer must re-sync first, a bad gradient
never becomes good.
"""

from __future__ import annotations

__all__ = [
    "ParameterPlaneError",
    "FencedError",
    "OffsetConflictError",
    "BadGradientError",
    "UnknownCodecError",
    "PayloadError",
    "LayoutError",
    "NoModelError",
    "BackpressureError",
    "CheckpointError",
]


class ParameterPlaneError(Exception):
    """Base of every parameter-plane error."""

    retriable: bool = False
    """True when the same call may succeed later without changing its input."""


class FencedError(ParameterPlaneError):
    """The push's generation is stale or a partition in it is owned by someone else.

    The trainer must re-sync its generation and partitions (heartbeat) before
    retrying a push for partitions it still owns.
    """


class OffsetConflictError(ParameterPlaneError):
    """A pushed offset range does not start at the committed offset (a gap or a
    duplicate), or the push's clock does not advance the member's last clock."""


class BadGradientError(ParameterPlaneError):
    """A gradient does not fit the model: wrong shard, shape or dtype, or NaN/inf values.

    The message names the shard (tensor name and index) and what was expected.
    """


class UnknownCodecError(ParameterPlaneError):
    """A codec name (or one part of a chain like ``topk+fp16``) is not registered."""


class PayloadError(ParameterPlaneError):
    """A msgpack payload is truncated, oversized, or not the expected structure."""


class LayoutError(ParameterPlaneError):
    """A model's tensors do not match the layout already stored for the job, or a stored shard does
    not fit it; :class:`NoModelError`, its subclass, when the job has no model yet."""


class NoModelError(LayoutError):
    """The job has no model in this Redis (an unknown job, or one whose model is not created yet):
    the one error every reader of the model's meta raises (``services.slots.read_meta``), so a
    caller that waits for the model catches this type.

    Args:
        job: the job.
        detail: what happened instead of the usual message (e.g. the model was removed meanwhile).
    """

    def __init__(self, job: str, detail: str | None = None) -> None:
        super().__init__(f"job {job}: {detail}" if detail else
                         f"job {job} has no model in this Redis (unknown job, or no model yet: no trainer has "
                         "initialised it)")
        self.job = job
        """The job without a model."""


class BackpressureError(ParameterPlaneError):
    """The update log is full: parameter servers are behind. Retry later."""

    retriable = True


class CheckpointError(ParameterPlaneError):
    """A checkpoint file (or its tables' pieces) is unreadable, incomplete or of another format, the
    target Redis already has the job, or no consistent cut could be read."""
