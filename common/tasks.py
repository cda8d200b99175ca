"""Ending a background task for certain: :func:`cancel_and_wait`.

On Python 3.11 ``asyncio.wait_for`` swallows a cancellation that arrives in the same
loop iteration as its inner future completes: it returns the result and the task runs
on, its cancellation spent. redis-py awaits every command it sends through
``wait_for`` when the client has a socket timeout (5 s by default since redis-py 6),
so a task cancelled while a Redis reply comes in can miss its cancellation and go
round its loop again, and a shutdown awaiting it waits for ever. Our own code waits
with ``asyncio.timeout``; what it cannot change, it cancels with :func:`cancel_and_wait`.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_S = 0.05
"""How long :func:`cancel_and_wait` waits for the task to end before it cancels it again."""


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and return once it has ended, cancelling it again every
    :data:`RECANCEL_S` for as long as it runs on (a ``None`` task is nothing to do).

    Raises:
        Exception: what the task raised, if it ended with an error of its own rather than
            by its cancellation.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error
