"""The listener and dial over loopback TCP: both transports on one port, containment of bad clients, dial errors."""

import logging
import socket
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

import transport.websocket as websocket
from transport import (
    DialError,
    ListenError,
    PrefixStream,
    WebSocketStream,
    dial,
    remote_host,
    serve_listener,
)


@asynccontextmanager
async def serving(handler):
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_listener, "127.0.0.1", 0, handler)
        yield port
        nursery.cancel_scope.cancel()


async def echo(stream):
    while data := await stream.receive_some():
        await stream.send_all(data)


async def exchange(stream, payload):
    got = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.send_all, payload)
        while len(got) < len(payload):
            chunk = await stream.receive_some()
            assert chunk
            got += chunk
    return bytes(got)


async def test_raw_and_websocket_clients_share_one_port():
    seen = []

    async def handler(stream):
        seen.append((type(stream), getattr(stream, "path", None), remote_host(stream)))
        await echo(stream)

    async with serving(handler) as port:
        raw = await dial(f"127.0.0.1:{port}")
        ws = await dial(f"ws://127.0.0.1:{port}/mesh")
        assert isinstance(raw, trio.SocketStream)
        assert isinstance(ws, WebSocketStream)
        assert await exchange(raw, b"\x01hello raw") == b"\x01hello raw"
        assert await exchange(ws, b"\x01hello ws") == b"\x01hello ws"
        assert remote_host(raw) == "127.0.0.1"
        assert remote_host(ws) == "127.0.0.1"
        assert raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        await raw.aclose()
        await ws.aclose()
    assert sorted(seen, key=str) == sorted(
        [(PrefixStream, None, "127.0.0.1"), (WebSocketStream, "/mesh", "127.0.0.1")], key=str
    )


async def test_three_mib_over_websocket_on_tcp():
    async with serving(echo) as port:
        ws = await dial(f"ws://127.0.0.1:{port}")
        payload = bytes(range(256)) * (3 * 1024 * 1024 // 256)
        assert await exchange(ws, payload) == payload
        await ws.aclose()


async def test_garbage_upgrade_is_refused_and_good_client_still_served(caplog):
    caplog.set_level(logging.INFO, logger="transport.listener")
    async with serving(echo) as port:
        bad = await trio.open_tcp_stream("127.0.0.1", port)
        good = await dial(f"ws://127.0.0.1:{port}/")
        await bad.send_all(b"GARBAGE / NOTHTTP\r\n\r\n")
        response = await bad.receive_some()
        assert response.startswith(b"HTTP/1.1 400")
        assert await bad.receive_some() == b""  # the listener closed it
        assert await exchange(good, b"still here") == b"still here"
        await bad.aclose()
        await good.aclose()
    assert "bad HTTP request" in caplog.text
    assert "127.0.0.1:" in caplog.text


async def test_failing_handler_is_contained_and_logged(caplog):
    calls = 0

    async def handler(stream):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("handler bug")
        await echo(stream)

    async with serving(handler) as port:
        first = await dial(f"127.0.0.1:{port}")
        await first.send_all(b"\x01")
        assert await first.receive_some() == b""  # closed after the handler failed
        second = await dial(f"ws://127.0.0.1:{port}")
        assert await exchange(second, b"ok") == b"ok"
        await first.aclose()
        await second.aclose()
    assert "handler failed" in caplog.text
    assert "handler bug" in caplog.text


async def test_client_that_leaves_at_once_is_harmless():
    async with serving(echo) as port:
        quitter = await trio.open_tcp_stream("127.0.0.1", port)
        await quitter.aclose()
        half = await trio.open_tcp_stream("127.0.0.1", port)
        await half.send_all(b"GET / HT")  # half an upgrade, then gone
        await half.aclose()
        ok = await dial(f"127.0.0.1:{port}")
        assert await exchange(ok, b"\x01x") == b"\x01x"
        await ok.aclose()


async def test_handler_stream_is_closed_when_handler_returns():
    async def handler(stream):
        await stream.send_all(b"bye")

    async with serving(handler) as port:
        for addr in (f"127.0.0.1:{port}", f"ws://127.0.0.1:{port}"):
            stream = await dial(addr)
            await stream.send_all(b"\x01")
            got = b""
            while chunk := await stream.receive_some():
                got += chunk
            assert got == b"bye"
            await stream.aclose()


def refused_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit, and nothing listens there


@pytest.mark.parametrize("scheme", ["", "ws://"])
async def test_dial_refused_names_address_and_reason(scheme):
    addr = f"{scheme}127.0.0.1:{refused_port()}"
    with pytest.raises(DialError) as info:
        await dial(addr)
    assert info.value.addr == addr
    assert addr in str(info.value)
    assert "refused" in str(info.value).lower()


async def test_dial_unresolvable_host():
    with pytest.raises(DialError, match=r"cannot dial no-such-host\.invalid:7000: cannot resolve host"):
        await dial("no-such-host.invalid:7000")


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (b"\x01\x02\x03 not http at all\r\n\r\n", "bad upgrade response"),
        (b"", "closed the connection before completing the upgrade"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", "refused the upgrade with HTTP 200"),
    ],
)
async def test_ws_dial_to_a_server_that_does_not_upgrade(answer, reason):
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]

    async def not_websocket():
        stream = await listener.accept()
        await stream.receive_some()
        if answer:
            await stream.send_all(answer)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(not_websocket)
        addr = f"ws://127.0.0.1:{port}/x"
        with pytest.raises(DialError) as info:
            await dial(addr)
    await listener.aclose()
    assert info.value.addr == addr
    assert reason in info.value.reason
    assert str(info.value).startswith(f"cannot dial {addr}: ")


async def test_listen_on_a_taken_port_raises_listen_error():
    async with serving(echo) as port:
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}"):
            await serve_listener("127.0.0.1", port, echo)


async def test_silent_client_is_dropped_after_the_grace(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="transport.listener")
    monkeypatch.setattr("transport.listener.HANDSHAKE_GRACE_S", 0.05)
    async with serving(echo) as port:
        silent = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(5):
            assert await silent.receive_some() == b""
        await silent.aclose()
    assert "showed no protocol" in caplog.text


# ---- the stream contract over real sockets ----


@asynccontextmanager
async def stream_pairs(scheme):
    accepted = trio.open_memory_channel(0)

    async def handler(stream):
        await accepted[0].send(stream)
        await trio.sleep_forever()  # the test owns the stream now

    async with serving(handler) as port:

        async def maker():
            client = await dial(f"{scheme}127.0.0.1:{port}")
            if scheme:
                return client, await accepted[1].receive()
            await client.send_all(b"\x01")  # the listener waits for a first byte
            server = await accepted[1].receive()
            assert await server.receive_some(1) == b"\x01"
            return client, server

        yield maker


async def test_websocket_over_tcp_check_two_way_stream(monkeypatch):
    monkeypatch.setattr(websocket, "CLOSE_GRACE_S", 0.05)
    async with stream_pairs("ws://") as maker:
        await trio.testing.check_two_way_stream(maker, None)


async def test_raw_listener_stream_check_half_closeable():
    async with stream_pairs("") as maker:
        await trio.testing.check_half_closeable_stream(maker, None)


def ipv6_loopback_missing():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as exc:
        return f"no IPv6 loopback here: {exc}"
    return None


@pytest.mark.skipif(ipv6_loopback_missing() is not None, reason=str(ipv6_loopback_missing()))
async def test_ipv6_addresses_dial_and_report_the_peer():
    hosts = []

    async def handler(stream):
        hosts.append(remote_host(stream))
        await echo(stream)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_listener, "::1", 0, handler)
        for addr in (f"[::1]:{port}", f"ws://[::1]:{port}/v6"):
            stream = await dial(addr)
            assert await exchange(stream, b"\x01six") == b"\x01six"
            assert remote_host(stream) == "::1"
            await stream.aclose()
        nursery.cancel_scope.cancel()
    assert hosts == ["::1", "::1"]


async def test_silent_connections_beyond_the_cap_are_closed_at_once():
    """Strangers that connect and say nothing hold a task each for the grace period; only so many at a time."""
    import trio

    from transport import serve_listener

    async def handler(stream) -> None:
        raise AssertionError("no connection here ever shows a protocol")

    closed = trio.open_memory_channel(8)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(lambda task_status: serve_listener("127.0.0.1", 0, handler, max_unclassified=3,
                                                                        task_status=task_status))
        clients = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(5)]

        async def watch(client) -> None:
            try:
                if await client.receive_some(1) == b"":
                    await closed[0].send(client)
            except trio.BrokenResourceError:
                await closed[0].send(client)

        for c in clients:
            nursery.start_soon(watch, c)
        with trio.fail_after(5):                 # well inside the 10 s grace: closed on accept
            first, second = await closed[1].receive(), await closed[1].receive()
        assert first is not second
        nursery.cancel_scope.cancel()
    for c in clients:
        await c.aclose()
