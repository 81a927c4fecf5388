"""Weight-shipping throughput on loopback TCP, against a plain copy of the same bytes in the same run.

    .venv/bin/python bench/ship_bench.py [--model PATH] [--range 0:30] [--repeat 3] [--rate 1gbit]

Both sides of each transfer run in separate processes (the receiver is this script with --serve), as they would
on two machines. The plain copy sends the planned file's bytes over one TCP connection and the receiver writes
them to a file and fsyncs it; the shipment goes through a Link (framing, auth, credit window, heartbeats) into
`serve_ship`, which also hashes every byte, resumes, and renames into place. The one-time SHA-256 of the plan
(the sender needs it for ShipBegin) is timed separately. With --rate the receiver runs in a network namespace
behind a rate-limited veth pair (root only), which is what a home lab's wire looks like.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.gguf_range import CHUNK_BYTES, plan_range_gguf  # noqa: E402

TOKEN = b"ship-bench-token"
CHUNK = [CHUNK_BYTES]  # the mesh sender's chunk size (--chunk)
CPU = [0.0]  # the receiver's CPU seconds (all threads) from accepting the connection to its end


def _smollm2() -> Path:
    from engine.sources import default_model_path
    return Path(default_model_path())


# ------------------------------------------------------------------------------------------------ receivers


async def _serve_plain(dest: Path, host: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    done = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        c0 = time.process_time()
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while True:
                data = await stream.receive_some(CHUNK_BYTES)
                if not data:
                    break
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        await stream.send_all(b"k")
        await stream.aclose()
        CPU[0] = time.process_time() - c0
        done.set()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host=host))
        task_status.started(listeners[0].socket.getsockname()[1])
        await done.wait()
        nursery.cancel_scope.cancel()


async def _serve_mesh(cache: Path, host: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
    from mesh import proto
    from mesh.link import LinkClosed, open_link
    from mesh.shipping import serve_ship

    done = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        c0 = time.process_time()
        try:
            async with open_link(stream, token=TOKEN, role="server") as link:
                while True:
                    ev = await link.receive()
                    if isinstance(ev, proto.ShipBegin):
                        await serve_ship(link, ev, cache)
        except* LinkClosed:
            pass  # the sender's Shutdown
        CPU[0] = time.process_time() - c0
        done.set()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host=host))
        task_status.started(listeners[0].socket.getsockname()[1])
        await done.wait()
        nursery.cancel_scope.cancel()


def serve_main(kind: str, where: Path, host: str) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            serve = _serve_plain if kind == "plain" else _serve_mesh
            port = await nursery.start(serve, where, host)
            print(port, flush=True)

    trio.run(main)
    print(CPU[0], flush=True)  # CPU seconds of every thread while serving, for the parent's accounting


# ------------------------------------------------------------------------------------------------ senders


class Shaped:
    """A network namespace behind a veth pair whose two ends are rate-limited (tbf): a home-lab wire, on one box."""

    def __init__(self, rate: str) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns, self.out, self.into = f"shipb{tag}", f"shpa{tag}", f"shpb{tag}"
        self.host, self.peer = "198.19.251.1", "198.19.251.2"  # 198.18.0.0/15 is for tests; other helpers use .0.x
        ip = ["ip", "-n", self.ns]
        self._run(["ip", "netns", "add", self.ns])
        try:
            self._run(["ip", "link", "add", self.out, "type", "veth", "peer", "name", self.into])
            self._run(["ip", "link", "set", self.into, "netns", self.ns])
            self._run(["ip", "addr", "add", f"{self.host}/30", "dev", self.out])
            self._run(["ip", "link", "set", self.out, "up"])
            self._run(ip + ["addr", "add", f"{self.peer}/30", "dev", self.into])
            self._run(ip + ["link", "set", self.into, "up"])
            self._run(ip + ["link", "set", "lo", "up"])
            for cmd in (["tc"], ["ip", "netns", "exec", self.ns, "tc"]):
                dev = self.out if cmd == ["tc"] else self.into
                self._run(cmd + ["qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb",
                                 "latency", "20ms"])
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _run(cmd: list[str]) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.out], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


SHAPED: Shaped | None = None


def _spawn(kind: str, where: Path) -> tuple[subprocess.Popen, str, int]:
    host = SHAPED.peer if SHAPED else "127.0.0.1"
    prefix = ["ip", "netns", "exec", SHAPED.ns] if SHAPED else []
    proc = subprocess.Popen(prefix + [sys.executable, __file__, "--serve", kind, "--where", str(where),
                                      "--host", host], stdout=subprocess.PIPE, text=True)
    return proc, host, int(proc.stdout.readline())


async def _send_plain(host: str, port: int, plan) -> tuple[float, float]:
    stream = await trio.open_tcp_stream(host, port)
    t0, c0 = time.perf_counter(), time.process_time()
    for chunk in plan.iter_chunks(0, CHUNK_BYTES):
        await stream.send_all(chunk)
    await stream.send_eof()
    assert await stream.receive_some(1) == b"k"
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    await stream.aclose()
    return dt, cpu


async def _send_mesh(host: str, port: int, plan) -> tuple[float, float]:
    from mesh import proto
    from mesh.link import open_link
    from mesh.shipping import ProgressBoard, ship_range

    stream = await trio.open_tcp_stream(host, port)
    with open(os.devnull, "w") as quiet:
        async with open_link(stream, token=TOKEN, role="client") as link:
            t0, c0 = time.perf_counter(), time.process_time()
            result = await ship_range(link, plan, board=ProgressBoard(quiet, tty=False), chunk=CHUNK[0])
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert result.sent_bytes == plan.size, result
            await link.send(proto.Shutdown())
    return dt, cpu


def run_one(kind: str, plan, work: Path) -> tuple[float, float, float]:
    """(wall seconds, sender CPU seconds, receiver CPU seconds for its whole life) of one transfer."""
    where = work / kind
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir()
    proc, host, port = _spawn(kind, where / "copy.gguf" if kind == "plain" else where)
    try:
        wall, cpu = trio.run(_send_plain if kind == "plain" else _send_mesh, host, port, plan)
    finally:
        out, _ = proc.communicate(timeout=60)
    return wall, cpu, float(out.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--range", default=None, help="start:end (default: every layer)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rate", default=None,
                    help="shape the wire to this tc rate (e.g. 1gbit) through a network namespace; needs root")
    ap.add_argument("--chunk", type=int, default=CHUNK_BYTES, help="mesh chunk size in bytes (default 1 MiB)")
    ap.add_argument("--serve", choices=["plain", "mesh"], help=argparse.SUPPRESS)
    ap.add_argument("--where", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve_main(args.serve, args.where, args.host)
        return
    global SHAPED
    CHUNK[0] = args.chunk
    if args.rate:
        SHAPED = Shaped(args.rate)
    try:
        bench(args)
    finally:
        if SHAPED:
            SHAPED.close()


def bench(args: argparse.Namespace) -> None:
    model = args.model or _smollm2()
    t0 = time.perf_counter()
    if args.range:
        start, end = (int(x) for x in args.range.split(":"))
    else:
        from engine.gguf_range import read_source_header
        start, end = 0, read_source_header(model).block_count
    plan = plan_range_gguf(model, start, end)
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan.sha256()
    t_hash = time.perf_counter() - t0
    mb = plan.size / 1e6
    wire = f"a {args.rate} shaped veth into a network namespace" if args.rate else "loopback TCP"
    print(f"over {wire}")
    print(f"model {model.name}, layers {start}..{end}: {mb:.1f} MB planned in {t_plan * 1e3:.0f} ms, "
          f"sha256 in {t_hash:.2f} s ({mb / t_hash:.0f} MB/s)")
    with tempfile.TemporaryDirectory(prefix="ship-bench-") as tmp:
        work = Path(tmp)
        runs: dict[str, list[tuple[float, float, float]]] = {"plain": [], "mesh": []}
        for i in range(args.repeat):  # interleaved, so a noisy neighbour hurts both sides alike
            for kind in ("plain", "mesh"):
                wall, send_cpu, recv_cpu = run_one(kind, plan, work)
                runs[kind].append((wall, send_cpu, recv_cpu))
                print(f"  run {i + 1} {kind:5s} {mb / wall:7.1f} MB/s; CPU ms per MB: sender "
                      f"{send_cpu / mb * 1e3:.2f}, receiver {recv_cpu / mb * 1e3:.2f}", flush=True)
    med = {k: [statistics.median(col) for col in zip(*v)] for k, v in runs.items()}
    (plain, p_send, p_recv), (mesh, m_send, m_recv) = med["plain"], med["mesh"]
    print(f"plain TCP copy {mb / plain:.1f} MB/s, mesh shipping {mb / mesh:.1f} MB/s (median of {args.repeat}); "
          f"ratio {plain / mesh:.2f}")
    print(f"CPU seconds (median): plain sender {p_send:.3f} receiver {p_recv:.3f}; "
          f"mesh sender {m_send:.3f} receiver {m_recv:.3f} (all threads, connection open to close)")


if __name__ == "__main__":
    main()
