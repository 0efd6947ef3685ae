"""The queue seam: JetStream stream, subjects and consumers of one application.

The producer publishes through `JetStreamQueue.publish`; consumers pull through
`JetStreamQueue.pull_subscription`. Both sides derive every name from siphon_core.naming.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import nats
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from siphon_core import naming


class QueueError(RuntimeError):
    """The queue refused or lost a request; the message says which stream or subject."""


@dataclass(frozen=True)
class StreamSettings:
    application_identifier: str
    duplicate_window_seconds: int = 600
    replicas: int = 1
    max_message_bytes: int = 1_048_576

    @property
    def stream(self) -> str:
        return naming.stream_name(self.application_identifier)

    @property
    def subjects(self) -> list[str]:
        return [f"{naming.subject_prefix(self.application_identifier)}.>",
                f"siphon_dead_letter.{naming.escape_subject_token(self.application_identifier)}.>"]


class JetStreamQueue:
    def __init__(self, url: str, settings: StreamSettings, name: str = "siphon") -> None:
        self.url = url
        self.settings = settings
        self._name = name
        self._nc: nats.NATS | None = None
        self._js: JetStreamContext | None = None

    async def connect(self, connect_timeout: float = 5.0) -> None:
        try:
            self._nc = await nats.connect(
                self.url, name=self._name, connect_timeout=connect_timeout,
                max_reconnect_attempts=-1, reconnect_time_wait=0.5, allow_reconnect=True,
            )
        except Exception as error:  # nats-py raises several unrelated types here
            raise QueueError(f"cannot connect to NATS at {self.url}: {error}") from None
        self._js = self._nc.jetstream(timeout=10.0)

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and not self._nc.is_closed

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise QueueError("queue is not connected")
        return self._js

    async def ensure_stream(self) -> None:
        """Creates the application's stream, or updates its subjects and limits."""
        config = StreamConfig(
            name=self.settings.stream,
            subjects=self.settings.subjects,
            storage=StorageType.FILE,
            num_replicas=self.settings.replicas,
            duplicate_window=float(self.settings.duplicate_window_seconds),
            max_msg_size=self.settings.max_message_bytes + 65_536,
            discard=DiscardPolicy.OLD,
        )
        try:
            info = await self.js.stream_info(config.name)
        except NotFoundError:
            await self.js.add_stream(config)
            return
        ours = naming.subject_prefix(self.settings.application_identifier) + ".>"
        theirs = list(info.config.subjects or [])
        if theirs and theirs[0] != ours:
            # Identifiers that differ only in punctuation (`a.b.1`, `a_b_1`) share a stream name;
            # rewriting the other application's subjects would cut its producer off.
            raise QueueError(
                f"JetStream stream {config.name} belongs to application "
                f"{naming.application_of_subject(theirs[0])!r} (subjects {theirs[0]}), whose name collides with "
                f"{self.settings.application_identifier!r}; choose an application_identifier that differs in "
                "letters or digits")
        await self.js.update_stream(config)

    async def publish(self, subject: str, payload: bytes, message_id: str, timeout: float = 30.0) -> int:
        """Publishes and waits for the stream's ack; returns the stream sequence."""
        ack = await self.js.publish(subject, payload, timeout=timeout, stream=self.settings.stream,
                                    headers={"Nats-Msg-Id": message_id})
        return ack.seq

    async def ensure_consumer(self, durable: str, subject: str, ack_wait_seconds: float = 300.0,
                              max_ack_pending: int = 10_000) -> None:
        config = ConsumerConfig(
            durable_name=durable,
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_seconds,
            max_ack_pending=max_ack_pending,
            max_deliver=-1,
        )
        try:
            await self.js.consumer_info(self.settings.stream, durable)
        except NotFoundError:
            await self.js.add_consumer(self.settings.stream, config)

    async def pull_subscription(self, durable: str, subject: str) -> JetStreamContext.PullSubscription:
        await self.ensure_consumer(durable, subject)
        return await self.js.pull_subscribe_bind(durable=durable, stream=self.settings.stream)

    async def pending(self, durable: str) -> int:
        """Messages not yet delivered plus delivered but not acked, for one consumer."""
        info = await self.js.consumer_info(self.settings.stream, durable)
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            try:
                await asyncio.wait_for(self._nc.drain(), timeout=10.0)
            except Exception:
                await self._nc.close()
        self._nc = None
        self._js = None
