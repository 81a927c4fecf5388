"""Raw TCP against our WebSocket stream on loopback, side by side: 4 KB round trip and throughput both ways.

    .venv/bin/python bench/transport_bench.py [--rounds 2000] [--mib 256] [--chunk-kib 1024] [--repeat 3]
    .venv/bin/python bench/transport_bench.py --cpu    # WebSocket CPU cost, both ends in this process

The server runs in a child process (as a real peer would), on one `serve_listener` port that takes both the raw and
the WebSocket client; the client dials `host:port` and `ws://host:port`. Each client stream opens with one mode
byte after the protocol's version byte: `E` echoes, `S` swallows an announced number of bytes and acks with one byte,
`R` sends an announced number of bytes in announced chunks. Over WebSocket the two directions differ: the client
masks what it sends (RFC 6455), so `up` (client to server) pays masking on both ends and `down` pays none.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transport import dial, serve_listener, ws_accept, ws_connect  # noqa: E402


async def receive_exactly(stream: trio.abc.Stream, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = await stream.receive_some(n - len(got))
        if not chunk:
            raise EOFError(f"stream ended after {len(got)} of {n} bytes")
        got += chunk
    return bytes(got)


async def handler(stream: trio.abc.Stream) -> None:
    mode = await receive_exactly(stream, 2)
    if mode == b"\x01E":
        while data := await stream.receive_some():
            await stream.send_all(data)
    elif mode == b"\x01S":
        left = int.from_bytes(await receive_exactly(stream, 8), "little")
        while left > 0:
            data = await stream.receive_some()
            if not data:
                raise EOFError(f"sink: {left} bytes short")
            left -= len(data)
        await stream.send_all(b"k")
    elif mode == b"\x01R":
        total = int.from_bytes(await receive_exactly(stream, 8), "little")
        chunk = int.from_bytes(await receive_exactly(stream, 8), "little")
        block = memoryview(b"\x5a" * chunk)
        for start in range(0, total, chunk):
            await stream.send_all(block[: min(chunk, total - start)])


async def serve() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_listener, "127.0.0.1", 0, handler)
        print(port, flush=True)
        # the parent closes our stdin to stop us
        await trio.to_thread.run_sync(sys.stdin.read)
        nursery.cancel_scope.cancel()


async def round_trips(addr: str, rounds: int, size: int) -> list[float]:
    stream = await dial(addr)
    await stream.send_all(b"\x01E")
    payload = b"\xa5" * size
    times = []
    for i in range(rounds + 50):
        t0 = time.perf_counter()
        await stream.send_all(payload)
        await receive_exactly(stream, size)
        if i >= 50:  # warm-up
            times.append(time.perf_counter() - t0)
    await stream.aclose()
    return times


async def throughput(addr: str, total: int, chunk: int) -> float:
    stream = await dial(addr)
    block = memoryview(b"\x5a" * chunk)
    t0 = time.perf_counter()
    await stream.send_all(b"\x01S" + total.to_bytes(8, "little"))
    sent = 0
    while sent < total:
        n = min(chunk, total - sent)
        await stream.send_all(block[:n])
        sent += n
    assert await receive_exactly(stream, 1) == b"k"
    elapsed = time.perf_counter() - t0
    await stream.aclose()
    return total / elapsed


async def download(addr: str, total: int, chunk: int) -> float:
    stream = await dial(addr)
    t0 = time.perf_counter()
    await stream.send_all(b"\x01R" + total.to_bytes(8, "little") + chunk.to_bytes(8, "little"))
    got = 0
    while got < total:
        data = await stream.receive_some()
        if not data:
            raise EOFError(f"download: {total - got} bytes short")
        got += len(data)
    elapsed = time.perf_counter() - t0
    await stream.aclose()
    return total / elapsed


async def client(port: int, args: argparse.Namespace) -> None:
    runs: dict[str, list[tuple[float, ...]]] = {"tcp": [], "websocket": []}
    total, chunk = args.mib * 1024 * 1024, args.chunk_kib * 1024
    # interleaved repeats, each figure the median over them: a shared machine's noise hits both sides alike
    for _ in range(args.repeat):
        for name, addr in (("tcp", f"127.0.0.1:{port}"), ("websocket", f"ws://127.0.0.1:{port}/bench")):
            rtt = await round_trips(addr, args.rounds, 4096)
            up = await throughput(addr, total, chunk)
            down = await download(addr, total, chunk)
            runs[name].append((statistics.median(rtt), sorted(rtt)[int(len(rtt) * 0.99)], up, down))
    rows = {name: tuple(statistics.median(r[i] for r in rs) for i in range(4)) for name, rs in runs.items()}
    tcp, ws = rows["tcp"], rows["websocket"]
    print(f"loopback, server in a child process; {args.rounds} round trips of 4 KB; "
          f"{args.mib} MiB each way in {args.chunk_kib} KiB send_all calls; median of {args.repeat} runs")
    print(f"{'':12}{'rtt median':>12}{'rtt p99':>12}{'up':>14}{'down':>14}")
    for name, (med, p99, up, down) in rows.items():
        print(f"{name:12}{med * 1e3:>9.3f} ms{p99 * 1e3:>9.3f} ms{up / 1e6:>9.0f} MB/s{down / 1e6:>9.0f} MB/s")
    print(f"{'ws / tcp':12}{ws[0] / tcp[0]:>11.2f}x{ws[1] / tcp[1]:>11.2f}x{ws[2] / tcp[2]:>13.2f}x"
          f"{ws[3] / tcp[3]:>13.2f}x")


async def cpu_costs(args: argparse.Namespace) -> None:
    """CPU time of both WebSocket ends over a socketpair: a figure that a loaded machine's scheduling does not blur."""

    async def pair(direction: str) -> tuple[trio.abc.Stream, trio.abc.Stream]:
        a, b = trio.socket.socketpair()
        ends: dict[str, trio.abc.Stream] = {}

        async def accept() -> None:
            ends["server"] = await ws_accept(trio.SocketStream(b))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept)
            ends["client"] = await ws_connect(trio.SocketStream(a), "bench:1", "/")
        return (ends["client"], ends["server"]) if direction == "up" else (ends["server"], ends["client"])

    async def bulk(direction: str, total: int, chunk: int) -> float:
        tx, rx = await pair(direction)
        block = memoryview(b"\x5a" * chunk)

        async def send() -> None:
            for start in range(0, total, chunk):
                await tx.send_all(block[: min(chunk, total - start)])

        t0 = time.process_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            got = 0
            while got < total:
                got += len(await rx.receive_some())
        return (time.process_time() - t0) / (total / 2**20)

    async def lockstep(direction: str, count: int, size: int) -> float:
        tx, rx = await pair(direction)
        message = b"\xa5" * size
        t0 = time.process_time()
        for _ in range(count):  # each message its own read, as in a decode hop
            await tx.send_all(message)
            got = 0
            while got < size:
                got += len(await rx.receive_some())
        return (time.process_time() - t0) / count

    total, chunk = args.mib * 1024 * 1024, args.chunk_kib * 1024
    print(f"WebSocket CPU, both ends in one process over a socketpair; median of {args.repeat} runs; "
          f"up = client to server (masked)")
    for direction in ("up", "down"):
        per_mib = statistics.median([await bulk(direction, total, chunk) for _ in range(args.repeat)])
        per_msg = statistics.median([await lockstep(direction, args.rounds, 2048) for _ in range(args.repeat)])
        print(f"{direction:6}{per_mib * 1e3:>8.2f} ms per MiB{per_msg * 1e6:>8.1f} us per 2 KB message")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--chunk-kib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="measure the WebSocket's CPU cost in this process")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu:
        trio.run(cpu_costs, args)
        return
    if args.serve:
        trio.run(serve)
        return
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())
        trio.run(client, port, args)
    finally:
        server.stdin.close()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
