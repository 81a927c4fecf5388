"""One listening port for both transports: raw protocol clients and WebSocket clients.

A WebSocket client opens with an HTTP `GET`, so its first byte is `G`; the protocol's first byte is its version
byte (1). The listener reads the first bytes, replays them through a `PrefixStream`, and upgrades when it sees `G`.
This needs the dialer to speak first, which our protocol's client always does (its Hello).

Each connection's handler runs in the listener's nursery; whatever it raises (except cancellation) is logged with
the peer's address and goes no further, so one bad connection never takes the listener down.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from .errors import HandshakeError, ListenError, TransportError
from .prefix import PrefixStream
from .websocket import DEFAULT_MAX_MESSAGE, ws_accept

log = logging.getLogger(__name__)

Handler = Callable[[trio.abc.Stream], Awaitable[object]]

# A client that connects must show what it is (first byte, and the whole upgrade if WebSocket) within this long.
# Not a caller timeout: the listener serves strangers, and a silent one must not hold a task forever.
HANDSHAKE_GRACE_S = 10.0
MAX_UNCLASSIFIED = 64
"""Connections one listener holds before they showed their first bytes (and finished a WebSocket upgrade); more are
closed at once, so silent strangers cannot pile up tasks and sockets for the grace period."""
_FIRST_READ = 64 * 1024


async def serve_listener(
    host: str | None,
    port: int,
    handler: Handler,
    *,
    max_message: int = DEFAULT_MAX_MESSAGE,
    max_unclassified: int = MAX_UNCLASSIFIED,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bind `host:port`, report the bound port through `task_status.started`, and serve until cancelled.

    Every accepted connection is handed to `await handler(stream)`: a raw TCP stream (its first bytes replayed) or
    an accepted `WebSocketStream`. The stream is closed when the handler returns. A bind failure raises
    `ListenError`. With port 0 the port is ephemeral, and only the first address `host` resolves to is served (two
    sockets would get two different ports). At most `max_unclassified` connections may be waiting to show their
    protocol at once; one more is closed on accept.
    """
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ListenError(host, port, exc.strerror or str(exc)) from None
    if port == 0 and len(listeners) > 1:
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]
    bound = listeners[0].socket.getsockname()[1]

    pending = [0]

    async def serve_one(raw: trio.SocketStream) -> None:
        await _serve_connection(raw, handler, max_message, pending, max_unclassified)

    task_status.started(bound)
    await trio.serve_listeners(serve_one, listeners)


async def _serve_connection(raw: trio.SocketStream, handler: Handler, max_message: int, pending: list[int],
                            limit: int) -> None:
    peer = _peer_name(raw)
    stream: trio.abc.Stream | None = None
    if pending[0] >= limit:
        log.warning("connection from %s closed: %d connections have not shown their protocol yet", peer, pending[0])
        await trio.aclose_forcefully(raw)
        return
    try:
        pending[0] += 1
        try:
            with trio.move_on_after(HANDSHAKE_GRACE_S) as scope:
                stream = await _classify(raw, peer, max_message)
        finally:
            pending[0] -= 1
        if scope.cancelled_caught:
            log.info("connection from %s showed no protocol within %.0f s; closed", peer, HANDSHAKE_GRACE_S)
            return
        if stream is None:
            return
        await handler(stream)
    except (TransportError, trio.BrokenResourceError) as exc:
        log.warning("connection from %s ended: %s", peer, exc)
    except Exception:
        log.exception("connection from %s: handler failed", peer)
    finally:
        try:
            await (stream if stream is not None else raw).aclose()
        except Exception as exc:  # closing a broken connection has nothing left to tell anyone
            log.debug("closing connection from %s: %s", peer, exc)


async def _classify(raw: trio.SocketStream, peer: str, max_message: int) -> trio.abc.Stream | None:
    """The stream the handler gets, or None if the client left or failed its upgrade (logged)."""
    try:
        first = await raw.receive_some(_FIRST_READ)
    except trio.BrokenResourceError as exc:
        log.info("connection from %s broke before its first byte: %s", peer, exc)
        return None
    if not first:
        log.debug("connection from %s closed before sending anything", peer)
        return None
    stream = PrefixStream(raw, first)
    if first[:1] != b"G":
        return stream
    try:
        return await ws_accept(stream, max_message=max_message, peer=peer)
    except HandshakeError as exc:
        log.warning("%s", exc)
        return None
    except trio.BrokenResourceError as exc:
        log.info("connection from %s broke during the WebSocket upgrade: %s", peer, exc)
        return None


def _peer_name(raw: trio.SocketStream) -> str:
    try:
        peer = raw.socket.getpeername()
    except OSError:
        return "an unknown peer"
    if isinstance(peer, tuple):
        host, port = peer[0], peer[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return str(peer)
