"""Applications whose identifiers map to one JetStream stream name refuse to share it."""

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
