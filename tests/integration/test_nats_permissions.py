"""deploy/nats/accounts.conf on a real nats-server: each user can do exactly what its side of Siphon
does (the calls siphon_core/queue.py and the streaming consumer make), and no more."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError

from siphon_core import naming
from siphon_core import queue as queue_reads
from siphon_core.queue import JetStreamQueue, StreamSettings
from siphon_stack.nats import find_nats_server
from siphon_stack.process import free_port, port_accepts, start_process, stop_pid, wait_until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "nats"
APPLICATION = "prod.main.1"  # the application accounts.conf is written for
PASSWORDS = {"SIPHON_PRODUCER_NATS_PASSWORD": "producer-secret", "SIPHON_DAGSTER_NATS_PASSWORD": "dagster-secret"}


@pytest.fixture(scope="module")
def secured_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    root = tmp_path_factory.mktemp("nats-accounts")
    port = free_port()
    (root / "accounts.conf").write_text((DEPLOY / "accounts.conf").read_text())
    (root / "server.conf").write_text(
        f'listen: 127.0.0.1:{port}\njetstream {{ store_dir: "{root / "js"}", sync_interval: always }}\n'
        "include ./accounts.conf\n")
    process = start_process("nats-server", [find_nats_server(), "-c", str(root / "server.conf")],
                            root / "nats.log", env=PASSWORDS)
    try:
        wait_until("nats-server", lambda: port_accepts(port), 30, pid=process.pid, log_path=root / "nats.log")
        yield port
    finally:
        stop_pid(process.pid)


def queue(port: int, user: str) -> JetStreamQueue:
    password = PASSWORDS[f"SIPHON_{user.split('-')[1].upper()}_NATS_PASSWORD"]
    return JetStreamQueue(f"nats://{user}:{password}@127.0.0.1:{port}", StreamSettings(APPLICATION))


def test_producer_and_dagster_users_can_do_their_part_and_no_more(secured_nats: int) -> None:
    subject = naming.table_subject(APPLICATION, "public", "notes")
    dead_letters = naming.dead_letter_subject(APPLICATION, "public", "notes")
    durable = naming.consumer_name("clickhouse", "public", "notes")
    gaps = naming.gap_subject(APPLICATION)

    async def run() -> None:
        producer, dagster = queue(secured_nats, "siphon-producer"), queue(secured_nats, "siphon-dagster")
        await producer.connect()
        await dagster.connect()
        try:
            # The producer: creates, then updates the stream; publishes packages.
            await producer.ensure_stream()
            await producer.ensure_stream()
            for number in range(3):
                await producer.publish(subject, b"package %d" % number, message_id=f"test:{number}")
            # What a producer whose slot was lost reads, and the gap record it then publishes.
            assert await producer.last_sequence() == 3
            assert (await producer.last_table_message())[0] == 3
            assert await producer.last_message(gaps) is None
            await producer.publish(gaps, b"gap", message_id="gap:1")
            # The Dagster side: stream set-up, a durable pull consumer, fetch, in-progress, ack.
            await dagster.ensure_stream()
            subscription = await dagster.pull_subscription(durable, subject)
            first, second, third = await subscription.fetch(3, timeout=5)
            await first.in_progress()
            await first.ack_sync()
            await second.ack()
            assert await dagster.pending(durable) >= 1
            # The gap sensor's and the checks' reads.
            assert [data for _, data in await dagster.messages_after(gaps, 0)] == [b"gap"]
            assert await queue_reads.last_sequence(dagster, subject) == 3
            assert (await queue_reads.consumer_position(dagster, durable)).ack_floor >= 1
            assert await queue_reads.oldest_after(dagster, subject, 0) is not None
            # A dead letter, as the dead_letter strategy publishes it.
            await dagster.js.publish(dead_letters, third.data, stream=dagster.settings.stream,
                                     headers={"Nats-Msg-Id": f"dead-letter:{durable}:3"})
            await third.ack_sync()
            # A replay from the ack floor recreates the consumer from its own config.
            info = await dagster.js.consumer_info(dagster.settings.stream, durable)
            await dagster.js.delete_consumer(dagster.settings.stream, durable)
            await dagster.js.add_consumer(dagster.settings.stream, dataclasses.replace(
                info.config, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=3))
            assert await dagster.pending(durable) == 1

            # And nothing else: the producer cannot read or dead-letter, the Dagster side cannot
            # publish packages or delete the stream.
            with pytest.raises((nats.errors.Error, APIError, TimeoutError)):
                await producer.js.add_consumer(producer.settings.stream, durable_name="intruder",
                                               filter_subject=subject, timeout=2)
            with pytest.raises((nats.errors.Error, APIError, TimeoutError)):
                await producer.js.consumer_info(producer.settings.stream, durable, timeout=2)
            with pytest.raises((nats.errors.Error, APIError, TimeoutError)):
                await producer.js.delete_stream(producer.settings.stream)
            with pytest.raises((nats.errors.Error, TimeoutError)):
                await producer.js.publish(dead_letters, b"x", timeout=2)
            with pytest.raises((nats.errors.Error, TimeoutError)):
                await dagster.js.publish(subject, b"x", timeout=2)
            with pytest.raises((nats.errors.Error, APIError, TimeoutError)):
                await dagster.js.delete_stream(dagster.settings.stream)
            assert (await dagster.js.stream_info(dagster.settings.stream)).state.messages == 5
        finally:
            await producer.close()
            await dagster.close()

    asyncio.run(run())
