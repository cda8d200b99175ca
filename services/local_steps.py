"""The rules of local steps (DiLoCo, a job's ``local_steps`` H > 1), written once.

What a job with local steps may run with (its optimizer, codec, model, the bounds of H and of the
outer optimizer), which inner optimizer a trainer runs, and how its clock wait differs. The
coordinator (a job's config and flags), ``streamtrain up`` (its flags, before anything starts) and
the trainers (on joining, and at each window's wait) all read them from here. It imports nothing
but :mod:`services.names`, so the coordinator reads it without torch or redis.

Why these rules: ``docs/parameter-plane.md``, *Local steps: an outer optimizer on
pseudo-gradients (DiLoCo)* and *Consistency models*.
"""

from __future__ import annotations

from collections.abc import Sequence

from .names import SPARSIFIERS

__all__ = ["INNER_OPTIMIZERS", "MAX_LOCAL_STEPS", "MAX_OUTER_LR", "MAX_OUTER_MOMENTUM_FLAG", "OUTER_OPTIMIZER",
           "WINDOW_POLL_S", "check_local_steps", "check_dense_model", "own_through"]

MAX_LOCAL_STEPS = 10_000
"""The largest H the flags take (``--local-steps``)."""
MAX_OUTER_LR = 10.0
"""The outer optimizer's learning rate is in ``[0, MAX_OUTER_LR]``."""
MAX_OUTER_MOMENTUM_FLAG = 0.999
"""The largest ``--outer-momentum`` the flags take (a job's config takes any value below 1)."""

INNER_OPTIMIZERS = {"sgd": "sgd", "adam": "adamw", "lazyadam": "adamw"}
"""The optimizers a job with local steps may name, and the trainers' inner optimizer for each: SGD
with momentum for ``sgd``, AdamW for ``adam`` and ``lazyadam`` (a replica is dense: "lazy" means
nothing there); ``trainers.local.inner_optimizer`` builds it. ``dgc`` is refused: its momentum
correction belongs to top-k gradients."""

OUTER_OPTIMIZER = "sgd"
"""The parameter servers' optimizer of pseudo-gradients: SGD with Nesterov momentum at the job's
``outer_lr`` and ``outer_momentum`` (``trainers.local.server_optimizer``)."""

WINDOW_POLL_S = 0.002
"""The longest pause between two reads of the clocks while a window's wait waits
(``services.consistency.wait_for_clock(max_poll_s=)``): once a window, for its own previous window
to be applied, where the default backoff to ``MAX_POLL_S`` (50 ms) added up to 50 ms to every window."""


def check_local_steps(local_steps: int, *, outer_lr: float, outer_momentum: float, optimizer: str, codec: str) -> None:
    """Refuse what a job with ``local_steps`` cannot run with (the message names the value and the way
    out); a job of one step per push runs with any optimizer and codec.

    Raises:
        ValueError: ``local_steps`` < 1, an outer lr or momentum out of bounds, or with ``local_steps`` > 1
            an optimizer outside :data:`INNER_OPTIMIZERS` or a codec with a sparsifier
            (``services.names.SPARSIFIERS``).
    """
    if not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
    if not 0.0 <= outer_lr <= MAX_OUTER_LR:
        raise ValueError(f"outer_lr must be in [0, {MAX_OUTER_LR:g}], got {outer_lr!r}")
    if not 0.0 <= outer_momentum < 1.0:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if local_steps == 1:
        return
    if optimizer not in INNER_OPTIMIZERS:
        raise ValueError(f"local_steps {local_steps} needs an optimizer the trainers can run as their inner "
                         f"optimizer ({', '.join(INNER_OPTIMIZERS)}), got {optimizer!r}: dgc's momentum "
                         "correction belongs to top-k gradients, not to local steps")
    sparsifier = next((part for part in codec.split("+") if part in SPARSIFIERS), None)
    if sparsifier is not None:
        raise ValueError(f"local_steps {local_steps} cannot run with codec {codec!r}: the outer Nesterov "
                         f"optimizer is dense (every push moves every coordinate through its momentum), and "
                         f"{sparsifier}'s bursts of accumulated pseudo-gradients make it overshoot; use a dense "
                         "codec (none, fp16, bf16, int8)")


def check_dense_model(local_steps: int, model: str, tables: Sequence[str]) -> None:
    """Refuse model ``model`` with embedding tables ``tables`` under ``local_steps`` > 1.

    Raises:
        ValueError: local steps and a model with embedding tables (their rows live in the parameter
            plane only and are pulled and applied step by step: a window over rows is not implemented).
    """
    if local_steps > 1 and tables:
        raise ValueError(f"{local_steps} local steps need a dense model; {model} has embedding tables "
                         f"({', '.join(tables)}), and local steps support dense models only (the tables' rows "
                         "are pulled and applied step by step); use local_steps 1")


def own_through(clock: int, own_from: int) -> int | None:
    """The clock up to which a window opening at ``clock`` needs this member's own updates applied
    (``wait_for_clock(own_through=)``), whatever the consistency model: all of its pushes under its
    member id (from ``own_from``) before this one; None before its first push. A pseudo-gradient is
    taken from the window's pull, and a window started on parameters lacking its own previous windows
    would push their progress again."""
    return clock - 1 if clock - 1 >= own_from else None
