"""One hop between two processes on this host: the one-way latency of a raw TCP ping-pong (the floor) and of a sealed
mesh Link on a decode step's hot path, with the writer's yield (common/handoff.py) on and off.

    .venv/bin/python bench/hop_bench.py [--size 16384] [--idle 0,3] [--messages 1000] [--rounds 3]

Each row: a parent process sends `size` bytes (the Link: a Step carrying that many activation bytes, sent with
`send_nowait` as a peer forwards), the child answers with a small message (the Link: Tokens, written from the
reader's `take` hook, as a peer computes a step in its reader), the parent waits for it (the Link: `pump`, as the
coordinator's decode loop reads its sink). `--idle MS`: the parent sleeps that long before each message, so both
processes wait between hops as a chain's peers do between steps (their caches and CPUs go cold). One-way = the
median round trip / 2; for the Link also the median of the parent's write to the child holding the opened frame
(`Link.wrote` to `Link.arrived`: the hop in of bench/mesh_bench.py). Rows alternate round by round.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from common import handoff  # noqa: E402
from mesh import proto  # noqa: E402
from mesh.link import LinkError, open_link  # noqa: E402

TOKEN = b"hop-bench-fleet-token-0123456789"


def _pair() -> tuple[socket.socket, int]:
    """A fork and a loopback TCP connection between the two processes (TCP_NODELAY both ends): (this process's end,
    the child's pid), 0 as the pid in the child."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port = ls.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        ls.close()
        s = socket.create_connection(("127.0.0.1", port))
    else:
        s, _ = ls.accept()
        ls.close()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s, pid


def raw_row(size: int, idle: float, n: int) -> dict:
    s, pid = _pair()
    if pid == 0:        # the child: blocking reads, answer 64 bytes
        while got := s.recv(1 << 20):
            while len(got) < size:
                got += s.recv(1 << 20)
            s.sendall(got[:64])
        os._exit(0)
    msg, rtt = b"x" * size, []
    for _ in range(n):
        time.sleep(idle)
        t = time.perf_counter()
        s.sendall(msg)
        got = 0
        while got < 64:
            got += len(s.recv(1 << 20))
        rtt.append(time.perf_counter() - t)
    s.close()
    os.waitpid(pid, 0)
    return {"one_way_us": statistics.median(rtt) / 2 * 1e6}


def link_row(size: int, idle: float, n: int, yield_on: bool) -> dict:
    handoff.YIELD = yield_on and hasattr(os, "sched_yield")
    r, w = os.pipe()        # the child's arrival times come back through it
    s, pid = _pair()
    step = proto.Step(0, 0, 7, (), proto.Activation("f32", (1, size // 4), bytes(size // 4 * 4)))
    if pid == 0:
        os.close(r)

        async def child() -> None:
            async with open_link(trio.SocketStream(trio.socket.from_stdlib_socket(s)), token=TOKEN,
                                 role="server") as link:
                link.hot = True
                arrived = []

                def take(ev) -> bool:
                    if not isinstance(ev, proto.Step) or not link.send_nowait(proto.Tokens(ev.group, (1,))):
                        return False
                    arrived.append(link.arrived)
                    return True
                link.take = take
                try:
                    while True:     # what `take` could not answer at once (a Pong was being written): queued
                        ev = await link.receive()
                        if isinstance(ev, proto.Step):
                            arrived.append(link.arrived)
                            await link.send(proto.Tokens(ev.group, (1,)))
                except LinkError:
                    pass
                finally:    # the parent hangs up when it is done: hand it what arrived when
                    os.write(w, " ".join(f"{a:.9f}" for a in arrived).encode())
        try:
            trio.run(child)
        finally:
            os._exit(0)
    os.close(w)

    async def parent() -> tuple[list[float], list[float]]:
        rtt, wrote = [], []
        async with open_link(trio.SocketStream(trio.socket.from_stdlib_socket(s)), token=TOKEN,
                             role="client") as link:
            got = trio.Event()

            def take(ev) -> bool:
                if not isinstance(ev, proto.Tokens):
                    return False
                got.set()
                return True
            link.take = take
            for _ in range(n):
                time.sleep(idle)
                got = trio.Event()
                t = time.perf_counter()
                if not link.send_nowait(step):
                    await link.send(step)
                wrote.append(link.wrote)
                while not got.is_set():     # as the coordinator's decode loop: pump, else trio's own wait
                    if not await link.pump():
                        await got.wait()
                rtt.append(time.perf_counter() - t)
        return rtt, wrote
    rtt, wrote = trio.run(parent)
    with os.fdopen(r, "rb") as f:
        arrived = [float(x) for x in f.read().split()]
    os.waitpid(pid, 0)
    hop = [a - b for a, b in zip(arrived, wrote)]
    return {"one_way_us": statistics.median(rtt) / 2 * 1e6, "hop_in_us": statistics.median(hop) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=16384, help="bytes one way (16384: an 8B shape's f32 hidden state)")
    ap.add_argument("--idle", default="0,3", help="ms the parent sleeps before each message, comma-separated")
    ap.add_argument("--messages", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = {}
    for _ in range(args.rounds):
        for idle in (float(x) for x in args.idle.split(",")):
            n = args.messages if idle == 0 else max(100, args.messages // 4)
            for name, fn in (("raw TCP", lambda: raw_row(args.size, idle / 1e3, n)),
                             ("Link, yield", lambda: link_row(args.size, idle / 1e3, n, True)),
                             (f"Link, {handoff.ENV}=0", lambda: link_row(args.size, idle / 1e3, n, False))):
                for k, v in fn().items():
                    rows.setdefault((idle, name), {}).setdefault(k, []).append(v)
    print(f"{os.cpu_count()} CPUs, {args.size} bytes one way, {args.rounds} rounds (medians of the rounds' medians), "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'idle ms':>8s}  {'row':<24s}{'one-way us':>12s}{'write to opened us':>20s}")
    for (idle, name), v in rows.items():
        hop = f"{statistics.median(v['hop_in_us']):20.1f}" if "hop_in_us" in v else ""
        print(f"{idle:8.1f}  {name:<24s}{statistics.median(v['one_way_us']):12.1f}{hop}")


if __name__ == "__main__":
    main()
