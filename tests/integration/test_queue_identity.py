"""Applications whose identifiers map to one JetStream stream name refuse to share it; the stream's
limits are Siphon's own where it sets them, and the operator's where it does not."""

import asyncio

import pytest

from siphon_core.queue import JetStreamQueue, QueueError, StreamSettings


def test_colliding_application_identifiers_are_refused_naming_the_other(nats_url: str, unique_name: str) -> None:
    first, second = f"{unique_name}.app.1", f"{unique_name}_app_1"

    async def run() -> None:
        owner = JetStreamQueue(nats_url, StreamSettings(first))
        intruder = JetStreamQueue(nats_url, StreamSettings(second))
        await owner.connect()
        await intruder.connect()
        try:
            await owner.ensure_stream()
            with pytest.raises(QueueError, match=rf"belongs to application '{first}'.*collides with '{second}'"):
                await intruder.ensure_stream()
            await owner.ensure_stream()  # the owner itself still may update it
            info = await owner.js.stream_info(owner.settings.stream)
            assert info.config.subjects == owner.settings.subjects
        finally:
            await owner.close()
            await intruder.close()

    asyncio.run(run())


def test_a_retention_limit_set_by_the_operator_survives_a_restart(nats_url: str, unique_name: str) -> None:
    async def run() -> None:
        queue = JetStreamQueue(nats_url, StreamSettings(unique_name))
        await queue.connect()
        try:
            await queue.ensure_stream()
            info = await queue.js.stream_info(queue.settings.stream)
            info.config.max_age = 7 * 24 * 3600.0
            info.config.max_bytes = 1 << 30
            await queue.js.update_stream(info.config)
            await queue.ensure_stream()  # what every producer and run does when it starts
            after = (await queue.js.stream_info(queue.settings.stream)).config
            assert after.max_age == 7 * 24 * 3600.0 and after.max_bytes == 1 << 30
        finally:
            await queue.close()

    asyncio.run(run())


def test_the_stream_takes_the_configured_consumer_limit_and_a_full_stream_is_named(nats_url: str,
                                                                                  unique_name: str) -> None:
    """JetStream 2.15 limits a stream that sets no limit to 1000 consumers; Siphon sets its own
    (`queue.max_consumers`), on an existing stream too, and a consumer the limit refuses is an
    error that names the setting."""

    async def run() -> None:
        small = JetStreamQueue(nats_url, StreamSettings(unique_name, max_consumers=2))
        await small.connect()
        try:
            await small.ensure_stream()
            assert (await small.js.stream_info(small.settings.stream)).config.max_consumers == 2
            for table in ("a", "b"):
                await small.ensure_consumer(f"{unique_name}_{table}", f"{small.settings.subjects[0][:-2]}.{table}")
            with pytest.raises(QueueError, match=r"has as many consumers as it allows.*queue.max_consumers"):
                await small.ensure_consumer(f"{unique_name}_c", f"{small.settings.subjects[0][:-2]}.c")
        finally:
            await small.close()
        larger = JetStreamQueue(nats_url, StreamSettings(unique_name))  # a restart with the default
        await larger.connect()
        try:
            await larger.ensure_stream()
            assert (await larger.js.stream_info(larger.settings.stream)).config.max_consumers == 10_000
            await larger.ensure_consumer(f"{unique_name}_c", f"{larger.settings.subjects[0][:-2]}.c")
        finally:
            await larger.close()

    asyncio.run(run())


def test_the_stream_lists_every_consumer_past_a_page_and_deletes_one(nats_url: str, unique_name: str) -> None:
    async def run() -> None:
        queue = JetStreamQueue(nats_url, StreamSettings(unique_name))
        await queue.connect()
        try:
            assert await queue.consumers() == []  # before the stream exists
            await queue.ensure_stream()
            subject = f"{queue.settings.subjects[0][:-1]}public.t"
            for i in range(300):  # the server lists 256 at a time
                await queue.ensure_consumer(f"c{i:03d}", subject)
            assert sorted(info.name for info in await queue.consumers()) == [f"c{i:03d}" for i in range(300)]
            assert await queue.delete_consumer("c007") is True
            assert await queue.delete_consumer("c007") is False
            assert len(await queue.consumers()) == 299
        finally:
            await queue.close()

    asyncio.run(run())
