"""How a queue client proves who it is and whom it talks to: TLS and the NATS login.

nats-py upgrades to TLS only when the server's first INFO line says `tls_required`: given a
`tls://` URL and a plain-text server (or an attacker who rewrites that line) it sends its CONNECT,
password included, in plain text. A client that asked for TLS therefore refuses such a server
before it sends anything, and checks its transport once connected.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.errors import Error as NatsError

from siphon_core.config import QueueConfig


class PlainTextRefused(NatsError):
    """The server offered no TLS to a client configured for TLS."""


@dataclass(frozen=True)
class QueueLogin:
    """The `queue:` settings that open a connection; secrets are left out of repr."""

    require_tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkey_seed_file: str | None = None
    creds_file: str | None = None

    @classmethod
    def from_config(cls, config: QueueConfig) -> QueueLogin:
        return cls(require_tls=config.wants_tls, tls_ca_file=config.tls_ca_file, tls_cert_file=config.tls_cert_file,
                   tls_key_file=config.tls_key_file, user=config.user, password=config.password, token=config.token,
                   nkey_seed_file=config.nkey_seed_file, creds_file=config.creds_file)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.require_tls:
            return None
        # Verifies the chain and the host name; the CA file replaces the system's roots.
        context = ssl.create_default_context(cafile=self.tls_ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.tls_cert_file and self.tls_key_file:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments of `nats.aio.client.Client.connect` for this login."""
        options: dict[str, Any] = {}
        context = self.ssl_context()
        if context is not None:
            options["tls"] = context
        if self.user is not None:
            options["user"], options["password"] = self.user, self.password
        if self.token is not None:
            options["token"] = self.token
        if self.nkey_seed_file is not None:
            options["nkeys_seed"] = self.nkey_seed_file
        if self.creds_file is not None:
            options["user_credentials"] = self.creds_file
        return options

    def client(self) -> Client:
        if not self.require_tls:
            return Client()
        _quiet_tls_eof_notice()
        return TlsOnlyClient()


# asyncio warns, in a line of its own, whenever a TLS server closes a connection whose protocol
# (nats-py's transport) would keep it half-open; a refused login ends that way, and the line would
# stand beside the error that says why.
_TLS_EOF_NOTICE = "returning true from eof_received() has no effect when using ssl"


def _drop_tls_eof_notice(record: logging.LogRecord) -> bool:
    return record.getMessage() != _TLS_EOF_NOTICE


def _quiet_tls_eof_notice() -> None:
    asyncio_log = logging.getLogger("asyncio")
    if _drop_tls_eof_notice not in asyncio_log.filters:
        asyncio_log.addFilter(_drop_tls_eof_notice)


class TlsOnlyClient(Client):
    """A NATS client that will not speak to a server without TLS (see the module's docstring)."""

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        # Called with the server's greeting before the TLS upgrade and before CONNECT is sent.
        if initial_connection and not info.get("tls_required") and not self.options.get("tls_handshake_first"):
            raise PlainTextRefused("nats: the server does not require TLS, and this client was configured for TLS "
                                   "(a tls:// URL or queue.tls_* settings); refusing to connect in plain text")
        await super()._process_info(info, initial_connection)


def transport_is_tls(client: Client) -> bool | None:
    """Whether the connected transport is TLS; None when this nats-py does not say."""
    transport = getattr(client, "_transport", None)
    writer = getattr(transport, "_io_writer", None)
    if writer is None:
        return None
    return writer.get_extra_info("ssl_object") is not None
