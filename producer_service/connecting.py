"""Connecting to the source without blocking the event loop, and telling a refused login from a
lost network.

A connect to a host that never answers blocks in libpq until the TCP connect gives up (minutes):
done on the loop, SIGTERM would wait that long. The connect runs on a daemon thread instead, and a
stop request abandons it at once (the thread ends with the process). A wrong password or a role
the server refuses is no network fault: retrying it only delays the one line that says so.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

import psycopg

T = TypeVar("T")

# SQLSTATE class 28 (invalid authorization specification) and what libpq says before a server
# speaks (no password given, a TLS requirement the server cannot meet).
_AUTHENTICATION_STATES = {"28000", "28P01"}
_AUTHENTICATION_WORDS = ("password authentication failed", "authentication failed", "no password supplied",
                         "no pg_hba.conf entry", "role \"", "certificate", "SSL error", "server does not support SSL")


class AuthenticationError(RuntimeError):
    """The source refused this login: retrying cannot help; the message says what to change."""


def is_authentication_failure(error: BaseException) -> bool:
    if getattr(error, "sqlstate", None) in _AUTHENTICATION_STATES:
        return True
    text = str(error)
    return isinstance(error, psycopg.OperationalError) and any(word in text for word in _AUTHENTICATION_WORDS)


def is_refused_login(error: BaseException) -> bool:
    """NATS said no to the credentials (as opposed to not answering)."""
    text = str(error).lower()
    return "authorization violation" in text or "authentication" in text or "user authentication" in text


async def connect_unless_stopped(connect: Callable[[], T], stop: asyncio.Event, what: str) -> T | None:
    """`connect()` on a daemon thread; None when `stop` is set first. Authentication failures are
    raised as AuthenticationError."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def attempt() -> None:
        try:
            result = connect()
        except BaseException as error:  # handed to the loop, raised there
            loop.call_soon_threadsafe(_settle, done, None, error)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=attempt, name=f"connect {what}", daemon=True).start()
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({done, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not done.done():
        # Asked to stop: a connection that still arrives is closed, not leaked.
        done.add_done_callback(lambda f: _close(f))
        return None
    error = done.exception()
    if error is not None:
        if is_authentication_failure(error):
            raise AuthenticationError(f"{what} refused the login: {str(error).strip()}") from None
        raise error
    return done.result()


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _close(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        close = getattr(future.result(), "close", None)
        if close is not None:
            close()
