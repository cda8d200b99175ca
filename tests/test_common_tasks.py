"""common.tasks.cancel_and_wait: a background task ends even when a cancellation is swallowed."""

from __future__ import annotations

import asyncio
import sys

import pytest

from common.tasks import cancel_and_wait


async def test_a_task_whose_cancellation_wait_for_swallowed_still_ends() -> None:
    """The race redis-py's commands run into on Python 3.11: the cancellation arrives in the loop
    iteration in which ``wait_for``'s inner future completes. 3.11's ``wait_for`` then returns the
    result and the task runs on into its next wait; ``cancel_and_wait`` cancels that one too."""
    reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    rounds: list[str] = []

    async def background() -> None:
        while True:  # a loop like the lease checker's: a command, then a sleep
            rounds.append(f"got {await asyncio.wait_for(reply, 5)}")
            await asyncio.sleep(3600)

    task = asyncio.create_task(background())
    await asyncio.sleep(0)  # the task now waits in wait_for
    reply.set_result(7)
    task.cancel()  # the same iteration: the reply's wake-up is already scheduled
    await asyncio.sleep(0.01)
    if sys.version_info < (3, 12):
        assert rounds == ["got 7"] and not task.done()  # swallowed: the task sleeps, its cancel spent
    await cancel_and_wait(task)
    assert task.cancelled()


async def test_a_task_that_swallows_every_cancellation_but_the_last_is_cancelled_again() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed == 3:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled() and swallowed == 3


async def test_an_error_the_task_ended_with_is_raised() -> None:
    async def failing() -> None:
        raise RuntimeError("the task's own error")

    task = asyncio.create_task(failing())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="the task's own error"):
        await cancel_and_wait(task)


async def test_a_finished_task_and_none_are_nothing_to_do() -> None:
    async def done() -> int:
        return 1

    task = asyncio.create_task(done())
    await task
    await cancel_and_wait(task)
    await cancel_and_wait(None)
    assert task.result() == 1
