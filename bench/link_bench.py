"""Codec and Link costs: frame encode+decode per decode-step message, a Step->Tokens round trip and bulk throughput
over loopback TCP through the Link (auth, credit window, heartbeats), against raw trio TCP for the same bytes.

    .venv/bin/python bench/link_bench.py [--seal-compare N]

Links are sealed (ChaCha20-Poly1305, mesh/proto/seal.py) as they always are now. `--seal-compare N` runs every
figure N times sealed and N times with sealing switched off in this process (Codec.seal made a no-op on both ends),
interleaved, and prints the medians side by side.
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import trio

from mesh import proto
from mesh.link import open_link

TOKEN = b"bench-fleet-token"
STEP = proto.Step(0, 0, 7, (), proto.Activation("f16", (1, 576), bytes(1152)))


def codec_cost(n: int = 20000, sealed: bool = True) -> float:
    codec = proto.Codec()
    if sealed:
        codec.seal(bytes(32), bytes(32))     # one codec seals and opens its own frames: same key both ways
    t = time.perf_counter()
    for _ in range(n):
        codec.receive_data(codec.send(STEP))
        codec.next_event()
    return (time.perf_counter() - t) / n * 1e6


async def link_figures(rounds: int = 2000, bulk_mb: int = 256) -> dict:
    chunk = proto.ShipChunk(0, bytes(1 << 20))
    out = {}

    async def handler(stream):
        async with open_link(stream, token=TOKEN, role="server") as link:
            while True:
                ev = await link.receive()
                if isinstance(ev, proto.Step):
                    await link.send(proto.Tokens(ev.group, (1,)))
                elif isinstance(ev, proto.ShipEnd):
                    await link.send(proto.Ack(proto.MsgType.SHIP_END))

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        async with open_link(await trio.open_tcp_stream("127.0.0.1", port), token=TOKEN, role="client") as link:
            t = time.perf_counter()
            for _ in range(rounds):
                await link.send(STEP)
                await link.receive()
            out["step_rtt_us"] = (time.perf_counter() - t) / rounds * 1e6
            t = time.perf_counter()
            for _ in range(bulk_mb):
                await link.send(chunk)
            await link.send(proto.ShipEnd(bytes(32)))
            await link.receive()
            out["link_MBps"] = bulk_mb / (time.perf_counter() - t)
        nursery.cancel_scope.cancel()

    async def echo(stream):  # the same request/reply sizes as Step -> Tokens, no framing, no Link
        while await stream.receive_some(1 << 16):
            await stream.send_all(bytes(20))

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        request = bytes(len(proto.Codec().send(STEP)))
        t = time.perf_counter()
        for _ in range(rounds):
            await stream.send_all(request)
            await stream.receive_some(1 << 16)
        out["raw_tcp_rtt_us"] = (time.perf_counter() - t) / rounds * 1e6
        await stream.aclose()
        nursery.cancel_scope.cancel()

    async def sink(stream):
        while await stream.receive_some(1 << 20):
            pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, sink, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        data = bytes(1 << 20)
        t = time.perf_counter()
        for _ in range(bulk_mb):
            await stream.send_all(data)
        await stream.aclose()
        out["raw_tcp_MBps"] = bulk_mb / (time.perf_counter() - t)
        nursery.cancel_scope.cancel()
    return out


def _run(sealed: bool) -> dict:
    real = proto.Codec.seal
    if not sealed:
        proto.Codec.seal = lambda self, send_key=None, receive_key=None: None
    try:
        out = trio.run(link_figures)
    finally:
        proto.Codec.seal = real
    out["codec_us"] = codec_cost(sealed=sealed)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seal-compare", type=int, default=0, metavar="N")
    args = ap.parse_args()
    if not args.seal_compare:
        print(f"codec encode+decode Step(f16 1x576): {codec_cost():.1f} us/frame (sealed)")
        for k, v in trio.run(link_figures).items():
            print(f"{k}: {v:.1f}")
    else:
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for _ in range(args.seal_compare):
            for sealed in (True, False):
                runs[sealed].append(_run(sealed))
        print(f"{'figure':<16}{'sealed':>12}{'not sealed':>12}{'ratio':>8}   (medians of {args.seal_compare} runs each)")
        for key in runs[True][0]:
            a = statistics.median(r[key] for r in runs[True])
            b = statistics.median(r[key] for r in runs[False])
            print(f"{key:<16}{a:>12.1f}{b:>12.1f}{a / b:>8.2f}")
