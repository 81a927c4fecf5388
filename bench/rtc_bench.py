"""Each rung of the transport ladder side by side, in one run: set-up time, 4 KB round trip, throughput.

    .venv/bin/python bench/rtc_bench.py [--rtt-rounds 200] [--mb 16] [--rtc-mb 8] [--setups 5] [--json]

TCP and WebSocket go through `transport.dial` / `transport.serve_listener` on loopback. WebRTC runs two
endpoints (two bridge threads, as two peers would have) in this process over this host's non-loopback addresses
(aioice offers no 127.0.0.1 host candidate; `--rtc-loopback` forces 127.0.0.1, as the tests do), with no STUN
server. Every figure is a median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from signaling import Side, open_rtc_endpoint  # noqa: E402
from transport import dial, serve_listener  # noqa: E402

MSG = 4096
ECHO, SINK = b"E", b"S"


async def handler(stream: trio.abc.Stream) -> None:
    """The far end of every rung: mode byte, then echo fixed-size messages, or swallow N bytes and ack once."""
    try:
        mode = await _exact(stream, 1)
    except EOFError:  # a set-up-only connection
        return
    if mode == ECHO:
        while True:
            try:
                msg = await _exact(stream, MSG)
            except EOFError:
                return
            await stream.send_all(msg)
    (n,) = struct.unpack("<Q", await _exact(stream, 8))
    left = n
    while left:
        chunk = await stream.receive_some(min(left, 1 << 20))
        if not chunk:
            raise EOFError(f"sink: stream ended with {left} of {n} bytes missing")
        left -= len(chunk)
    await stream.send_all(b"k")


async def _exact(stream: trio.abc.Stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise EOFError("stream ended")
        buf += chunk
    return bytes(buf)


async def measure(open_stream: Callable[[], Awaitable[trio.abc.Stream]], setups: int, rounds: int,
                  nbytes: int) -> dict[str, float]:
    setup_s = []
    for _ in range(setups):
        t0 = time.perf_counter()
        s = await open_stream()
        setup_s.append(time.perf_counter() - t0)
        await s.aclose()
    s = await open_stream()
    await s.send_all(ECHO)
    msg = bytes(range(256)) * (MSG // 256)
    rtts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await s.send_all(msg)
        await _exact(s, MSG)
        rtts.append(time.perf_counter() - t0)
    await s.aclose()
    s = await open_stream()
    block = b"\xa5" * (1 << 20)
    t0 = time.perf_counter()
    await s.send_all(SINK + struct.pack("<Q", nbytes))
    sent = 0
    while sent < nbytes:
        piece = block[: min(len(block), nbytes - sent)]
        await s.send_all(piece)
        sent += len(piece)
    assert await _exact(s, 1) == b"k"
    elapsed = time.perf_counter() - t0
    await s.aclose()
    return {
        "setup_ms": round(statistics.median(setup_s) * 1e3, 2),
        "rtt_4k_ms": round(statistics.median(rtts) * 1e3, 3),
        "mb_per_s": round(nbytes / 1e6 / elapsed, 1),
    }


async def main(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_listener, "127.0.0.1", 0, handler)
        results["tcp"] = await measure(lambda: dial(f"127.0.0.1:{port}"), args.setups, args.rtt_rounds,
                                       args.mb << 20)
        results["websocket"] = await measure(lambda: dial(f"ws://127.0.0.1:{port}/"), args.setups,
                                             args.rtt_rounds, args.mb << 20)
        async with open_rtc_endpoint() as offerer, open_rtc_endpoint() as answerer:

            async def rtc_stream() -> trio.abc.Stream:
                with trio.fail_after(30):
                    answer = await answerer.accept_offer(await offerer.make_offer())
                    await offerer.finish(answer)
                    near = await offerer.open_stream(Side.OFFERER)
                    far = await answerer.open_stream(Side.ANSWERER)
                nursery.start_soon(_serve_and_close, far)
                return near

            results["webrtc"] = await measure(rtc_stream, args.setups, args.rtt_rounds, args.rtc_mb << 20)
        nursery.cancel_scope.cancel()
    return results


async def _serve_and_close(stream: trio.abc.Stream) -> None:
    try:
        await handler(stream)
    except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", type=int, default=5)
    parser.add_argument("--rtt-rounds", type=int, default=200)
    parser.add_argument("--mb", type=int, default=64, help="MiB pushed through TCP and WebSocket")
    parser.add_argument("--rtc-mb", type=int, default=8, help="MiB pushed through the WebRTC data channel")
    parser.add_argument("--rtc-loopback", action="store_true", help="WebRTC host candidates on 127.0.0.1 only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import aioice.ice
    if args.rtc_loopback or not aioice.ice.get_host_addresses(True, True):
        aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: ["127.0.0.1"]
    out = trio.run(main, args)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'rung':<10} {'set-up ms':>10} {'4 KB rtt ms':>12} {'MB/s':>8}")
        for rung, r in out.items():
            print(f"{rung:<10} {r['setup_ms']:>10} {r['rtt_4k_ms']:>12} {r['mb_per_s']:>8}")
