"""The publisher against a JetStream double that stores in arrival order, drops duplicates by
Nats-Msg-Id and checks Nats-Expected-Last-Msg-Id, with faults injected per publish."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
import pytest

from producer_service.metrics import ProducerMetrics
from producer_service.packaging import OutgoingPackage
from producer_service.publisher import EXPECTED_LAST_MESSAGE_ID, Publisher
from siphon_core.queue import QueueError


@dataclass
class FakeJetStream:
    """faults: publish call number (1-based) -> 'lose' (never stored, no answer), 'lose-ack' (stored,
    no answer), 'unavailable' (refused, JetStream not ready), 'refuse' (a permanent error)."""

    faults: dict[int, str] = field(default_factory=dict)
    stored: list[str] = field(default_factory=list)
    calls: int = 0
    last_id: str = ""

    def store_foreign(self, message_id: str) -> None:  # e.g. a consumer's dead letter
        self.stored.append(message_id)
        self.last_id = message_id

    async def publish(self, subject, payload, timeout, stream, headers):
        self.calls += 1
        fault = self.faults.get(self.calls)
        message_id = headers["Nats-Msg-Id"]
        # The server handles a message as it arrives: before the client's first wait.
        if fault == "lose":
            await asyncio.sleep(timeout)
            raise nats.errors.TimeoutError
        if fault == "unavailable":
            raise nats.js.errors.ServiceUnavailableError(code=503, description="JetStream not ready")
        if fault == "refuse":
            raise nats.js.errors.BadRequestError(code=400, err_code=10054, description="maximum payload exceeded")
        if message_id not in self.stored:
            expected = headers.get(EXPECTED_LAST_MESSAGE_ID)
            if expected is not None and expected != self.last_id:
                await asyncio.sleep(0)
                raise nats.js.errors.BadRequestError(code=400, err_code=10070, description="wrong last msg ID")
            self.stored.append(message_id)
            self.last_id = message_id
        if fault == "lose-ack":
            await asyncio.sleep(timeout)
            raise nats.errors.TimeoutError
        for _ in range(3):  # the ack takes a while
            await asyncio.sleep(0)
        return object()


class FakeQueue:
    def __init__(self, js: FakeJetStream) -> None:
        self.js = js

        class Settings:
            stream = "SIPHON_UNIT"

        self.settings = Settings()


def package(number: int, table: int = 1) -> OutgoingPackage:
    return OutgoingPackage(b"payload %d" % number, table, f"public.t{table}", f"t{table}:{number}", number, 1, 10,
                           number)


def run(faults: dict[int, str], count: int = 30, foreign_after: int | None = None, window: int = 8,
        retry_seconds: float = 5.0) -> tuple[FakeJetStream, list[str], Publisher]:
    js = FakeJetStream(faults)
    acked: list[str] = []

    async def scenario() -> Publisher:
        publisher = Publisher(FakeQueue(js), ProducerMetrics(), lambda p: acked.append(p.message_id),
                              max_pending=64, window=window, publish_timeout_seconds=0.05,
                              retry_seconds=retry_seconds)
        for number in range(count):
            publisher.submit(package(number, table=1 + number % 2), f"subject.{1 + number % 2}")
            if number == foreign_after:
                await asyncio.sleep(0.01)
                js.store_foreign("dead-letter")
        await asyncio.wait_for(publisher.wait_for_acks(), 10)
        await publisher.close()
        return publisher

    publisher = asyncio.run(scenario())
    return js, acked, publisher


def submitted(count: int = 30) -> list[str]:
    return [package(n, 1 + n % 2).message_id for n in range(count)]


def test_without_faults_packages_are_stored_in_cut_order_and_each_acked_once():
    js, acked, publisher = run({})
    assert js.stored == submitted()
    assert sorted(acked) == sorted(submitted()) and publisher.failure is None


@pytest.mark.parametrize("fault", ["lose", "lose-ack", "unavailable"])
def test_a_failed_publish_in_the_middle_of_the_window_never_reorders_the_stream(fault):
    js, acked, publisher = run({5: fault, 6: "lose"})
    assert js.stored == submitted()  # nothing after a missing package got in ahead of it, and no copies
    assert sorted(acked) == sorted(submitted()) and publisher.failure is None
    assert js.calls > 30  # something was sent again


def test_a_foreign_message_in_between_only_restarts_the_chain():
    js, acked, publisher = run({}, foreign_after=10)
    ours = [message_id for message_id in js.stored if message_id != "dead-letter"]
    assert ours == submitted() and sorted(acked) == sorted(submitted())


def test_a_permanent_refusal_fails_the_publisher_with_the_package_named():
    js = FakeJetStream({3: "refuse"})

    async def scenario() -> Publisher:
        publisher = Publisher(FakeQueue(js), ProducerMetrics(), lambda p: None, max_pending=64, window=4,
                              publish_timeout_seconds=0.05)
        for number in range(6):
            publisher.submit(package(number), "subject.1")
        await asyncio.wait_for(publisher.wait_for_acks(), 5)
        await publisher.close()
        return publisher

    publisher = asyncio.run(scenario())
    assert isinstance(publisher.failure, QueueError)
    assert "JetStream refused package t1:2" in str(publisher.failure) and "maximum payload" in str(publisher.failure)
    assert js.stored == ["t1:0", "t1:1"]


def test_a_queue_that_never_answers_fails_after_the_retry_budget():
    js, _, publisher = run({n: "lose" for n in range(1, 1000)}, count=3, retry_seconds=0.3)
    assert isinstance(publisher.failure, QueueError) and "failed for 0s" in str(publisher.failure)
    assert js.stored == []


def test_backpressure_and_idle_tables():
    js = FakeJetStream()

    async def scenario() -> None:
        publisher = Publisher(FakeQueue(js), ProducerMetrics(), lambda p: None, max_pending=3, window=2)
        for number in range(3):
            publisher.submit(package(number, table=1), "subject.1")
        assert publisher.pending == 3 and not publisher.table_is_idle(1) and publisher.table_is_idle(2)
        assert await publisher.wait_for_room(timeout=5)
        assert publisher.pending < 3
        await asyncio.wait_for(publisher.wait_for_acks(), 5)
        assert publisher.table_is_idle(1)
        await publisher.close()

    asyncio.run(scenario())
    assert js.stored == ["t1:0", "t1:1", "t1:2"]
