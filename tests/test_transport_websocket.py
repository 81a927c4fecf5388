"""WebSocketStream over in-memory stream pairs: the trio stream contract, large messages, limits, control frames."""

import pytest
import trio
import trio.testing
import wsproto
import wsproto.events as wse

import transport.websocket as websocket
from transport import HandshakeError, PrefixStream, WebSocketError, WebSocketStream, ws_accept, ws_connect


@pytest.fixture
def short_linger(monkeypatch):
    # a closing side lingers for the peer's Close; the checks include a peer that never reads, so keep it short
    monkeypatch.setattr(websocket, "CLOSE_GRACE_S", 0.05)


async def upgrade(a, b, **kwargs):
    """Client handshake on `a`, server handshake on `b`, concurrently."""
    out = {}

    async def client():
        out["client"] = await ws_connect(a, "test.local:1", "/mesh", **kwargs)

    async def server():
        out["server"] = await ws_accept(b, **kwargs)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        nursery.start_soon(server)
    return out["client"], out["server"]


async def memory_ws_pair(**kwargs):
    return await upgrade(*trio.testing.memory_stream_pair(), **kwargs)


async def lockstep_ws_pair():
    return await upgrade(*trio.testing.lockstep_stream_pair())


async def test_check_two_way_stream(short_linger):
    await trio.testing.check_two_way_stream(memory_ws_pair, lockstep_ws_pair)


async def test_three_mib_message_crosses_intact():
    client, server = await memory_ws_pair()
    payload = bytes(range(256)) * (3 * 1024 * 1024 // 256)
    got = bytearray()

    async def receive():
        while len(got) < len(payload):
            got.extend(await server.receive_some())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await client.send_all(payload)
    assert got == payload
    assert server.path == "/mesh"


async def test_send_all_is_one_message_fragmented_into_frames():
    a, b = trio.testing.memory_stream_pair()
    client, raw = await upgrade_client_only(a, b)
    payload = b"z" * (websocket.FRAME_BYTES * 2 + 5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_all, payload)
        events = await read_server_events(raw, until=lambda e: isinstance(e, wse.BytesMessage) and e.message_finished)
    data = [e for e in events if isinstance(e, wse.BytesMessage)]
    assert b"".join(e.data for e in data) == payload
    assert [e.message_finished for e in data].count(True) == 1


async def test_message_over_limit_breaks_with_1009():
    client, server = await memory_ws_pair(max_message=1000)
    server_small = server
    # the client splits at its own limit; make the sender think the limit is larger than the receiver's
    client.max_message = 5000
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_all, b"x" * 3000)
        got = bytearray()
        with pytest.raises(WebSocketError) as info:
            while True:
                got.extend(await server_small.receive_some())
    assert info.value.code == 1009
    assert "1000 bytes" in str(info.value)
    assert isinstance(info.value, trio.BrokenResourceError)
    assert len(got) <= 1000
    # the sender learns of it as a Close with that code
    assert await client.receive_some() == b""
    with pytest.raises(trio.BrokenResourceError):
        await client.send_all(b"more")


async def test_send_all_over_limit_is_split_into_messages_the_peer_accepts():
    client, server = await memory_ws_pair(max_message=1000)
    payload = bytes(range(250)) * 20  # 5000 bytes: five messages of 1000
    got = bytearray()

    async def receive():
        while len(got) < len(payload):
            got.extend(await server.receive_some())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await client.send_all(payload)
    assert got == payload


async def test_text_message_is_refused_with_1003():
    a, b = trio.testing.memory_stream_pair()
    raw, server = await upgrade_server_only(a, b)
    await a.send_all(raw.send(wse.TextMessage(data="hello")))
    with pytest.raises(WebSocketError, match="text message") as info:
        await server.receive_some()
    assert info.value.code == 1003


async def test_ping_is_answered_and_data_still_flows():
    a, b = trio.testing.memory_stream_pair()
    raw, server = await upgrade_server_only(a, b)
    # the ping arrives between two frames of one message, as RFC 6455 allows
    await a.send_all(
        raw.send(wse.BytesMessage(data=b"da", message_finished=False))
        + raw.send(wse.Ping(payload=b"p1"))
        + raw.send(wse.BytesMessage(data=b"ta"))
    )
    got = bytearray()
    while len(got) < 4:
        got += await server.receive_some()
    assert got == b"data"
    raw.receive_data(await a.receive_some())
    assert [e for e in raw.events()] == [wse.Pong(payload=b"p1")]


async def test_garbage_frame_breaks_the_stream_with_a_close_code():
    a, b = trio.testing.memory_stream_pair()
    raw, server = await upgrade_server_only(a, b)
    await a.send_all(b"\x8f\x80\x00\x00\x00\x00")  # opcode 0xF does not exist
    with pytest.raises(WebSocketError, match="Invalid opcode 0xf") as info:
        await server.receive_some()
    assert info.value.code == 1002
    with pytest.raises(WebSocketError):
        await server.send_all(b"x")


async def test_peer_close_gives_eof_and_is_answered():
    a, b = trio.testing.memory_stream_pair()
    raw, server = await upgrade_server_only(a, b)
    await a.send_all(raw.send(wse.BytesMessage(data=b"last")) + raw.send(wse.CloseConnection(code=1000)))
    assert await server.receive_some() == b"last"
    assert await server.receive_some() == b""
    assert await server.receive_some() == b""
    raw.receive_data(await a.receive_some())
    assert [type(e) for e in raw.events()] == [wse.CloseConnection]
    with pytest.raises(trio.BrokenResourceError, match="peer closed the WebSocket .code 1000"):
        await server.send_all(b"x")
    await server.aclose()


async def test_abrupt_transport_eof_reads_as_eof():
    a, b = trio.testing.memory_stream_pair()
    raw, server = await upgrade_server_only(a, b)
    await a.send_all(raw.send(wse.BytesMessage(data=b"tail")))
    await a.aclose()
    assert await server.receive_some() == b"tail"
    assert await server.receive_some() == b""


async def test_client_bytes_sent_right_after_the_request_are_kept():
    a, b = trio.testing.memory_stream_pair()
    raw = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    request = raw.send(wse.Request(host="h:1", target="/"))
    # a client may pipeline its first frame behind the upgrade request: still data for the accepted stream
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.send_all, request)
        server = await ws_accept(b)
    raw.receive_data(await a.receive_some())
    assert [type(e) for e in raw.events()] == [wse.AcceptConnection]
    await a.send_all(raw.send(wse.BytesMessage(data=b"first")))
    assert await server.receive_some() == b"first"


@pytest.mark.parametrize(
    ("request_bytes", "status", "reason"),
    [
        (b"GARBAGE\r\n\r\n", b"400", "bad HTTP request"),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"400", "Connection: Upgrade"),
        (
            b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 8\r\n\r\n",
            b"426",
            "Sec-WebSocket-Version",
        ),
        (b"G" + b"A" * 20000, b"400", "bad HTTP request"),
    ],
)
async def test_bad_upgrade_gets_http_error_and_handshake_error(request_bytes, status, reason):
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(request_bytes)
    with pytest.raises(HandshakeError, match=reason) as info:
        await ws_accept(b, peer="10.1.2.3:555")
    assert "10.1.2.3:555" in str(info.value)
    response = await a.receive_some()
    assert response.startswith(b"HTTP/1.1 " + status)


async def test_client_sees_refusal_as_handshake_error():
    a, b = trio.testing.memory_stream_pair()

    async def refuse():
        await b.receive_some()
        await b.send_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(refuse)
        with pytest.raises(HandshakeError, match="HTTP 404"):
            await ws_connect(a, "h:1", "/")


async def test_client_sees_server_leaving_as_handshake_error():
    a, b = trio.testing.memory_stream_pair()

    async def leave():
        await b.receive_some()
        await b.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leave)
        with pytest.raises(HandshakeError, match="closed the connection"):
            await ws_connect(a, "h:1", "/")


async def test_aclose_completes_the_close_handshake():
    client, server = await memory_ws_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.aclose)
        assert await server.receive_some() == b""
    # the client lingered until the server's answer, so both sides saw a clean close
    assert client._got_close == 1000
    assert server._got_close == 1000


async def test_prefix_stream_replays_then_reads_on():
    a, b = trio.testing.memory_stream_pair()
    stream = PrefixStream(b, b"abcdef")
    await a.send_all(b"ghi")
    assert await stream.receive_some(2) == b"ab"
    assert await stream.receive_some() == b"cdef"
    assert await stream.receive_some() == b"ghi"
    await stream.send_all(b"back")
    assert await a.receive_some() == b"back"
    await stream.send_eof()
    assert await a.receive_some() == b""
    await stream.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive_some()


async def test_prefix_stream_check_half_closeable():
    async def maker():
        a, b = trio.testing.memory_stream_pair()
        return PrefixStream(a, b""), PrefixStream(b, b"")

    await trio.testing.check_half_closeable_stream(maker, None)


# ---- helpers: one side is a bare wsproto connection we drive by hand ----


async def upgrade_server_only(a, b, **kwargs):
    raw = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.send_all, raw.send(wse.Request(host="h:1", target="/")))
        server = await ws_accept(b, **kwargs)
    raw.receive_data(await a.receive_some())
    assert [type(e) for e in raw.events()] == [wse.AcceptConnection]
    return raw, server


async def upgrade_client_only(a, b):
    raw = wsproto.WSConnection(wsproto.ConnectionType.SERVER)

    async def accept():
        raw.receive_data(await b.receive_some())
        assert [type(e) for e in raw.events()] == [wse.Request]
        await b.send_all(raw.send(wse.AcceptConnection()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        client = await ws_connect(a, "h:1", "/")
    return client, (raw, b)


async def read_server_events(raw_and_stream, until):
    raw, stream = raw_and_stream
    events = []
    while True:
        raw.receive_data(await stream.receive_some())
        for event in raw.events():
            events.append(event)
            if until(event):
                return events


assert issubclass(WebSocketStream, trio.abc.Stream)


async def test_largest_protocol_frame_crosses_as_one_message():
    # a 64 MiB payload plus the 8-byte header is the protocol's largest frame: one send_all, one message
    a, b = trio.socket.socketpair()
    client, server = await upgrade(trio.SocketStream(a), trio.SocketStream(b))
    size = 64 * 1024 * 1024 + 8
    assert size <= websocket.DEFAULT_MAX_MESSAGE
    payload = memoryview(bytearray(size))
    payload[-5:] = b"tail!"
    received = 0
    last = b""

    async def receive():
        nonlocal received, last
        while received < size:
            chunk = await server.receive_some()
            received += len(chunk)
            last = bytes(chunk[-5:])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await client.send_all(payload)
    assert received == size
    assert last == b"tail!"
    assert server._error is None
    await trio.aclose_forcefully(client)
    await trio.aclose_forcefully(server)


async def test_aclose_returns_even_when_the_peer_reads_nothing(monkeypatch):
    monkeypatch.setattr(websocket, "CLOSE_GRACE_S", 0.05)
    a, b = trio.testing.lockstep_stream_pair()  # every write waits for the peer to read
    client, server = await upgrade(a, b)
    with trio.fail_after(5):
        await client.aclose()  # server never reads: the Close cannot even be written
    with pytest.raises(trio.ClosedResourceError):
        await client.send_all(b"x")


# ---- frames wsproto refuses, the size limit, partial frames: what the stream makes of them ----


def client_frame(first: int, payload: bytes = b"", *, masked: bool = True) -> bytes:
    """One frame as a client would write it; a zero masking key leaves the payload readable."""
    assert len(payload) <= 125
    if not masked:
        return bytes([first, len(payload)]) + payload
    return bytes([first, 0x80 | len(payload)]) + b"\0\0\0\0" + payload


async def close_code_sent(raw, a):
    """The code of the Close the stream under test wrote to the raw peer."""
    raw.receive_data(await a.receive_some())
    closes = [e for e in raw.events() if isinstance(e, wse.CloseConnection)]
    assert len(closes) == 1
    return closes[0].code


@pytest.mark.parametrize(
    ("wire", "code", "reason"),
    [
        (client_frame(0x82, b"x", masked=False), 1002, "unmasked frame"),
        (client_frame(0xC2, b"x"), 1002, "Reserved bit"),
        (client_frame(0x8F), 1002, "Invalid opcode"),
        (client_frame(0x80, b"x"), 1002, "unexpected CONTINUATION"),
        (client_frame(0x02, b"a") + client_frame(0x82, b"b"), 1002, "expected CONTINUATION"),
        (client_frame(0x09), 1002, "fragment control frame"),
        (client_frame(0x81, b"hi"), 1003, "text message"),
        (client_frame(0x02, b"a" * 60) + client_frame(0x80, b"b" * 60), 1009, "limit of 100 bytes"),
        (client_frame(0x88, b"\x03"), 1002, "1 byte payload"),
        (client_frame(0x88, (1005).to_bytes(2, "big")), 1002, "local-only"),
        (client_frame(0x88, (2000).to_bytes(2, "big")), 1002, "unknown reserved code"),
        (client_frame(0x88, (1000).to_bytes(2, "big") + b"\xff\xfe"), 1007, "CLOSE reason"),
    ],
)
async def test_bad_frames_break_the_stream_with_their_close_code(wire, code, reason):
    a, b = trio.testing.memory_stream_pair()
    raw, server = await upgrade_server_only(a, b, max_message=100)
    await a.send_all(wire)
    got = bytearray()
    with pytest.raises(WebSocketError, match=reason) as info:
        while True:
            got += await server.receive_some()
    assert info.value.code == code
    assert len(got) <= 100  # nothing past the limit is handed out
    assert await close_code_sent(raw, a) == code
    with pytest.raises(WebSocketError):
        await server.send_all(b"x")
    with pytest.raises(WebSocketError):
        await server.receive_some()
    await server.aclose()


async def test_payload_is_handed_out_as_it_arrives_and_the_limit_holds_as_it_accumulates():
    a, b = trio.testing.memory_stream_pair()
    raw, server = await upgrade_server_only(a, b, max_message=1500)
    # one frame announcing 2**40 bytes: wsproto shows no header, so it cannot be refused before its payload
    await a.send_all(b"\x82\xff" + (1 << 40).to_bytes(8, "big") + b"\0\0\0\0" + b"a" * 1000)
    assert await server.receive_some() == b"a" * 1000  # without waiting for the rest of the frame
    await a.send_all(b"b" * 1000)
    with pytest.raises(WebSocketError, match="limit of 1500 bytes") as info:
        await server.receive_some()
    assert info.value.code == 1009
    assert await close_code_sent(raw, a) == 1009


async def test_server_frames_right_behind_the_101_are_kept():
    a, b = trio.testing.memory_stream_pair()
    raw = wsproto.WSConnection(wsproto.ConnectionType.SERVER)

    async def accept():
        raw.receive_data(await b.receive_some())
        assert [type(e) for e in raw.events()] == [wse.Request]
        # the 101 and the first message in one write: one read on the client gets both
        await b.send_all(raw.send(wse.AcceptConnection()) + raw.send(wse.BytesMessage(data=b"first")))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        client = await ws_connect(a, "h:1", "/")
    assert await client.receive_some() == b"first"


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        (b"NOT HTTP\r\n\r\n", "bad upgrade response"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n", "accept token"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * 20000, "bad upgrade response"),
    ],
)
async def test_client_sees_garbage_response_as_handshake_error(response, reason):
    a, b = trio.testing.memory_stream_pair()

    async def answer():
        await b.receive_some()
        await b.send_all(response)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        with pytest.raises(HandshakeError, match=reason):
            await ws_connect(a, "h:1", "/")


async def test_request_head_split_across_reads_keeps_the_bytes_after_it():
    a, b = trio.testing.memory_stream_pair()
    raw = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    request = raw.send(wse.Request(host="h:1", target="/split"))
    assert request.endswith(b"\r\n\r\n")
    # the blank line straddles two reads, and the first frame rides in the second
    first, second = request[:-2], request[-2:]  # "\r\n" | "\r\n"

    async def send():
        await a.send_all(first)
        await trio.testing.wait_all_tasks_blocked()
        await a.send_all(second + client_frame(0x82, b"early"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        server = await ws_accept(b)
    assert server.path == "/split"
    with trio.fail_after(5):  # bytes lost to wsproto's handshake would leave this read waiting forever
        assert await server.receive_some() == b"early"


async def test_ping_right_behind_the_request_is_answered_before_the_first_read_waits():
    a, b = trio.testing.memory_stream_pair()
    raw = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.send_all, raw.send(wse.Request(host="h:1", target="/")) + client_frame(0x89, b"early"))
        server = await ws_accept(b)
    raw.receive_data(await a.receive_some())
    assert [type(e) for e in raw.events()] == [wse.AcceptConnection]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.receive_some)
        with trio.fail_after(5):  # a pong left queued behind the read would never come
            raw.receive_data(await a.receive_some())
        assert list(raw.events()) == [wse.Pong(payload=b"early")]
        await a.send_all(raw.send(wse.BytesMessage(data=b"x")))  # lets the pending read return
