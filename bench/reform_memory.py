"""Memory per re-form, in one coordinator process (issue 12, Faults): the soak's coordinator grew 1-4 MB a re-form.

    .venv/bin/python bench/reform_memory.py --reforms 20 [--tracemalloc] [--peers 2]

Starts `--peers` `mesh-peer` processes (real model, default SmolLM2), forms a session in this process `--reforms`
times (each with a Scheduler and one short greedy answer, as the service does), and after each session prints this
process's RSS, the Python heap (tracemalloc, with --tracemalloc), and the object types whose counts grew.
"""
from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.memory import status_kb  # noqa: E402

TOKEN = b"reform-memory-token-0123456789abcdef"


def rss_mb() -> float:
    return status_kb("VmRSS") / 1024


def malloc_mb() -> tuple[float, float]:
    """glibc's view (mallinfo2): bytes in use and bytes free but kept, in the main and thread arenas."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    m = libc.mallinfo2()
    return (m.uordblks + m.hblkhd) / 2**20, m.fordblks / 2**20


def tree_rss_mb(pid: int) -> list[float]:
    """RSS of a process and of each of its children (a peer and its worker), MB."""
    out = []
    for q in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{q}/status") as f:
                out += [int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:")]
        except OSError:
            pass
    return out


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def type_counts() -> Counter:
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reforms", type=int, default=20)
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) after each session")
    p.add_argument("--streams", type=int, default=1, help="answers at once in each session")
    p.add_argument("--kill", action="store_true", help="every other session, SIGKILL p0 mid-answer (the session "
                   "fails; the next forms on the survivor, the one after on both again, as in the soak)")
    args = p.parse_args()

    import trio
    import tracemalloc

    from mesh.coordinator import CoordConfig, Coordinator
    from mesh.scheduler import Request, Scheduler
    from mesh.session import open_session
    from tests.mesh_fixtures import child_env, free_port

    if args.model is None:
        from engine.sources import default_model_path
        args.model = default_model_path()
    reg = free_port()
    def start_peer(i: int):
        return subprocess.Popen([sys.executable, "-m", "mesh", "peer", "--join", f"127.0.0.1:{reg}", "--listen",
                               "127.0.0.1:0", "--model", str(args.model), "--token", TOKEN.decode(), "--name",
                               f"p{i}"], cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL,
                              stderr=open(f"/tmp/reform_memory_p{i}.log", "ab"), start_new_session=True)
    procs = [start_peer(i) for i in range(args.peers)]

    async def run() -> None:
        coord = Coordinator(CoordConfig(model=args.model, listen=f"127.0.0.1:{reg}", token=TOKEN, settle=0.5,
                                        min_peers=args.peers, placement="memory", n_slots=4))
        ids = coord.encode("What is the capital of France?", template="auto")
        async with trio.open_nursery() as nursery:
            await coord.serve_registry(nursery)
            before = None
            snap0 = None
            for k in range(args.reforms):
                t0 = time.monotonic()
                kill = args.kill and k % 3 == 0
                need = args.peers if not args.kill or k % 3 == 2 else 1
                out, failed = [], ""
                try:
                    async with open_session(coord, min_peers=need, wait=600) as s:
                        members = s.members
                        sched = Scheduler(s.pipe, n_slots=4, max_seqs=4, max_context=coord.cfg.max_context,
                                          max_queue=8)
                        await s.start(sched.run)
                        async def one(i: int) -> None:
                            prompt = tuple(ids) + tuple(ids[:i * 7 % len(ids)])
                            async with sched.open(Request(prompt, args.tokens + 30 * kill)) as gen:
                                async for t in gen:
                                    if i == 0:
                                        out.append(t)
                                    if kill and i == 0 and len(out) == 3:
                                        procs[0].kill()
                        async with trio.open_nursery() as answers:
                            for i in range(args.streams):
                                answers.start_soon(one, i)
                        del sched
                except Exception as exc:
                    failed = f" ({type(exc).__name__}: {str(exc)[:60]})"
                if kill:
                    procs[0].wait()
                    procs[0] = start_peer(0)
                with trio.fail_after(60):
                    await coord.registry.wait_rejoined(members, 1 if kill else need)
                del members, s
                counts = type_counts()
                if args.trim:
                    import ctypes
                    ctypes.CDLL("libc.so.6").malloc_trim(0)
                used, kept = malloc_mb()
                line = (f"session {k:3d} ({need} peers{', p0 killed' if kill else ''}): {time.monotonic() - t0:5.1f}s"
                        f"  RSS {rss_mb():6.1f} MB  malloc in use {used:6.1f} free-kept {kept:6.1f}  objects "
                        f"{sum(counts.values())}{failed}"
                        f"  peers {[[round(x) for x in tree_rss_mb(pr.pid)] for pr in procs]}")
                if args.tracemalloc:
                    if snap0 is None and k == 1:
                        tracemalloc.start(25)
                    elif tracemalloc.is_tracing():
                        line += f"  traced {tracemalloc.get_traced_memory()[0] / 1e6:.2f} MB"
                print(line, f"tokens {len(out)}", flush=True)
                if before is not None:
                    grew = [(n, c - before.get(n, 0)) for n, c in counts.items() if c > before.get(n, 0)]
                    grew.sort(key=lambda x: -x[1])
                    if grew:
                        print("    grew:", ", ".join(f"{n} +{d}" for n, d in grew[:args.top]), flush=True)
                before = counts
                if k == 3:
                    at3 = counts
                if k == args.reforms - 1 and args.reforms > 4:
                    grew = sorted(((n, c - at3.get(n, 0)) for n, c in counts.items() if c > at3.get(n, 0)),
                                  key=lambda x: -x[1])
                    print(f"grown since session 3 ({k - 3} sessions):", ", ".join(f"{n} +{d}" for n, d in grew[:20]))
                if args.tracemalloc and tracemalloc.is_tracing():
                    snap = tracemalloc.take_snapshot()
                    if snap0 is not None:
                        for st in snap.compare_to(snap0, "traceback")[:3]:
                            if st.size_diff > 10_000:
                                print(f"    +{st.size_diff / 1e3:.0f} kB {st.count_diff:+d} blocks at:")
                                for fr in st.traceback.format()[-12:]:
                                    print("       ", fr)
                    snap0 = snap
            nursery.cancel_scope.cancel()
    try:
        trio.run(run)
    finally:
        for pr in procs:
            pr.kill()
            pr.wait()


if __name__ == "__main__":
    main()
