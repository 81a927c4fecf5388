"""`dial`: one call for every address a peer may advertise, `host:port` (raw TCP) or `ws://host:port[/path]`."""

from __future__ import annotations

import trio

from .addr import parse_addr
from .errors import DialError, HandshakeError
from .tcp import open_tcp
from .websocket import DEFAULT_MAX_MESSAGE, ws_connect


async def dial(addr: str, *, max_message: int = DEFAULT_MAX_MESSAGE) -> trio.abc.Stream:
    """Open a byte stream to `addr`.

    A malformed string raises `AddressError`; an unresolvable, unreachable or refusing address, or a server that
    refuses the WebSocket upgrade, raises `DialError(addr, reason)`. Bounding the time is the caller's
    (`trio.fail_after`).
    """
    target = parse_addr(addr)
    stream = await open_tcp(target.host, target.port, addr=addr)
    if target.scheme == "tcp":
        return stream
    try:
        return await ws_connect(stream, target.hostport, target.path, max_message=max_message)
    except HandshakeError as exc:
        await trio.aclose_forcefully(stream)
        raise DialError(addr, exc.reason) from None
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(stream)
        raise DialError(addr, f"the connection broke during the WebSocket upgrade: {exc.__cause__ or exc}") from None
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
