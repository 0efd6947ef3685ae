"""`Turns`: the run's write turns, a table's first batch ahead of later ones, cancellation safe."""

from __future__ import annotations

import asyncio

import pytest

from siphon_dagster.streaming.turns import Turn, Turns


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_at_most_count_turns_are_held_and_a_release_hands_one_on() -> None:
    async def scenario() -> None:
        turns = Turns(2)
        await turns.acquire()
        assert not turns.locked()
        await turns.acquire()
        assert turns.locked()
        third = asyncio.ensure_future(turns.acquire())
        await _settle()
        assert not third.done()
        turns.release()
        await _settle()
        assert third.done() and turns.locked()
        turns.release()
        turns.release()
        assert not turns.locked()

    asyncio.run(scenario())


def test_a_first_batch_goes_ahead_of_later_batches_that_waited_longer() -> None:
    async def scenario() -> None:
        turns = Turns(1)
        await turns.acquire()
        granted: list[str] = []

        async def wait(name: str, first: bool) -> None:
            await turns.acquire(first)
            granted.append(name)

        waiters = [asyncio.ensure_future(wait("later-1", False)), asyncio.ensure_future(wait("later-2", False))]
        await _settle()
        waiters.append(asyncio.ensure_future(wait("first", True)))
        await _settle()
        for _ in range(3):
            turns.release()
            await _settle()
        assert granted == ["first", "later-1", "later-2"]

    asyncio.run(scenario())


def test_a_waiter_cancelled_holds_no_turn_and_the_next_one_gets_it() -> None:
    async def scenario() -> None:
        turns = Turns(1)
        await turns.acquire()
        cancelled = asyncio.ensure_future(turns.acquire())
        waiting = asyncio.ensure_future(turns.acquire())
        await _settle()
        cancelled.cancel()
        await _settle()
        turns.release()
        await _settle()
        assert cancelled.cancelled() and waiting.done()
        turns.release()
        assert not turns.locked()

    asyncio.run(scenario())


def test_a_turn_granted_as_its_wait_is_cancelled_is_handed_on() -> None:
    async def scenario() -> None:
        turns = Turns(1)
        await turns.acquire()
        granted_then_cancelled = asyncio.ensure_future(turns.acquire())
        waiting = asyncio.ensure_future(turns.acquire())
        await _settle()
        turns.release()  # grants the first waiter, which is cancelled before it resumes
        granted_then_cancelled.cancel()
        await _settle()
        assert granted_then_cancelled.cancelled()
        assert waiting.done()  # the turn went on to the next waiter instead of being lost
        turns.release()
        assert not turns.locked()

    asyncio.run(scenario())


def test_turns_need_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least one, not 0"):
        Turns(0)


def test_first_batches_take_their_own_turns_and_later_batches_never_do() -> None:
    async def scenario() -> None:
        turns = Turns(1, first_extra=2)
        shared = await turns.acquire()
        assert shared is Turn.SHARED and turns.locked() and not turns.locked(first=True)
        own = [await turns.acquire(first=True), await turns.acquire(first=True)]
        assert own == [Turn.FIRST_ONLY, Turn.FIRST_ONLY] and turns.locked(first=True)
        later = asyncio.ensure_future(turns.acquire())
        first = asyncio.ensure_future(turns.acquire(first=True))
        await _settle()
        turns.release(own[0])  # a first batch's own turn goes to the first batch waiting, never to a later one
        await _settle()
        assert first.done() and first.result() is Turn.FIRST_ONLY and not later.done()
        turns.release(own[1])
        await _settle()
        assert not later.done()
        turns.release(shared)
        await _settle()
        assert later.done() and later.result() is Turn.SHARED
        assert not turns.locked(first=True) and turns.locked()  # one own turn free, the shared one held

    asyncio.run(scenario())


def test_a_first_batch_takes_its_own_turn_before_a_shared_one() -> None:
    async def scenario() -> None:
        turns = Turns(1, first_extra=1)
        assert await turns.acquire(first=True) is Turn.FIRST_ONLY
        assert not turns.locked()  # the shared turn is left for a later batch
        assert await turns.acquire(first=True) is Turn.SHARED
        assert turns.locked() and turns.locked(first=True)

    asyncio.run(scenario())


def test_own_turns_of_first_batches_are_zero_or_more() -> None:
    with pytest.raises(ValueError, match="zero or more, not -1"):
        Turns(1, first_extra=-1)
