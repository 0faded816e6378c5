from __future__ import annotations

import asyncio

import pytest

from infermesh.tasks import cancel_and_wait


async def test_a_task_that_swallows_a_cancellation_is_still_stopped():
    swallowed = 0

    async def survives_one_cancellation() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # as a cancellation turned into a caught TimeoutError would be

    task = asyncio.create_task(survives_one_cancellation())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), 2)
    assert task.cancelled() and swallowed == 1


async def test_a_failure_of_the_task_is_raised():
    async def fails() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="boom"):
        await cancel_and_wait(task)
