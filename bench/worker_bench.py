"""What the worker process costs on top of the stage it runs.

    DEV=CUDA .venv/bin/python bench/worker_bench.py   # on a GPU: the worker and stages use $DEV (default: tinygrad's)
    .venv/bin/python bench/worker_bench.py            # ring copies, control round trip, per-step overhead (tiny model)
    .venv/bin/python bench/worker_bench.py --smollm2  # plus SmolLM2 decode: in-process Stage vs 1 worker vs 2 chained

Per-step overhead is the step's wall time at the client minus the compute time the child measured around
Stage.step: JSON lines both ways, the pipe wake-ups and both ring copies.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.arena import INGRESS, Arena, RingReader, RingWriter  # noqa: E402
from engine.stage import Column, Sampling, Stage  # noqa: E402
from engine.worker import open_worker  # noqa: E402


def ring_copies() -> None:
    arena = Arena.create(64 << 20)
    w, r = RingWriter(arena, INGRESS), RingReader(arena, INGRESS)
    for rows in (1, 512, 2048):
        x = np.random.default_rng(0).random((rows, 576), dtype=np.float32)
        n = 200 if rows == 1 else 20
        r.take(w.write(0, x))  # warm the pages
        t0 = time.perf_counter()
        for i in range(n):
            r.take(w.write(i, x))
        dt = (time.perf_counter() - t0) / n
        print(f"ring write+take ({rows}, 576) f32, {x.nbytes / 1e6:.2f} MB: {dt * 1e6:.0f} us "
              f"({x.nbytes / dt / 1e9:.2f} GB/s)")
    arena.close()


async def tiny_overheads() -> None:
    from tests.tiny_gguf import write_tiny_gguf
    with tempfile.TemporaryDirectory() as d:
        path = write_tiny_gguf(Path(d) / "tiny.gguf", n_layers=2, dim=64, vocab_size=256)
        async with open_worker(device=None) as w:
            print(f"worker ready: device {w.ready.device}, probe {w.ready.probe_ms:.0f} ms")
            await w.load(path, 0, 1, n_slots=2, max_context=256)
            n = 200
            t0 = time.perf_counter()
            for _ in range(n):
                await w.rollback(0, 0)
            print(f"control round trip (Rollback): {(time.perf_counter() - t0) / n * 1e6:.0f} us")
            for i in range(3):  # compile and capture
                await w.step([Column(i, 0, False, 5)], None, Sampling())
            walls, computes, legs = [], [], []
            for i in range(3, 203):
                t0 = time.monotonic_ns() / 1e6
                await w.step([Column(i, 0, False, 5)], None, Sampling())
                t1 = time.monotonic_ns() / 1e6
                env = w.events[-1]
                c = env.event.compute_ms
                walls.append(t1 - t0)
                computes.append(c)
                # client before the write | write to the child's decode..encode minus compute | emit to read | after
                legs.append((w.sent_mono_ms - t0, env.mono_ms - w.sent_mono_ms - c, w.received_mono_ms - env.mono_ms,
                             t1 - w.received_mono_ms))
            over = np.median(np.array(walls) - np.array(computes))
            print(f"tiny decode step: wall {np.median(walls):.3f} ms, compute {np.median(computes):.3f} ms, "
                  f"worker overhead {over:.3f} ms (medians of {len(walls)})")
            pre, child, back, post = np.median(np.array(legs), axis=0) * 1000
            print(f"  overhead legs (medians, us): client before the write {pre:.0f}, write -> child's event minus "
                  f"compute {child:.0f}, event -> client's read {back:.0f}, client after the read {post:.0f}")


async def smollm2(n: int = 40) -> None:
    from engine.sources import default_model_path
    path = default_model_path()
    prompt = list(range(100, 130))

    async def decode(step) -> tuple[list[int], float]:
        tok = int((await step([Column(i, 0, i == len(prompt) - 1, t) for i, t in enumerate(prompt)]))[0])
        toks = [tok]
        for k in range(n + 4):
            if k == 4:
                t0 = time.perf_counter()
            tok = int((await step([Column(len(prompt) + k, 0, True, tok)]))[0])
            toks.append(tok)
        return toks, n / (time.perf_counter() - t0)

    stage = Stage.load(path, 0, 30, n_slots=1, max_context=128)

    async def local(cols):
        return stage.step(cols, None, Sampling())
    t_local, r_local = await decode(local)
    del stage
    async with open_worker(device=None) as a, open_worker(device=None) as b:
        await a.load(path, 0, 30, n_slots=1, max_context=128)

        async def one(cols):
            return await a.step(cols, None, Sampling())
        t_one, r_one = await decode(one)
        await a.load(path, 0, 15, n_slots=1, max_context=128)
        await b.load(path, 15, 30, n_slots=1, max_context=128)

        async def two(cols):
            return await b.step(cols, await a.step(cols, None, Sampling()), Sampling())
        t_two, r_two = await decode(two)
    print(f"SmolLM2 decode tok/s over {n} steps: in-process Stage {r_local:.1f}, one worker {r_one:.1f}, "
          f"two chained workers {r_two:.1f}; same tokens: {t_local == t_one == t_two}")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smollm2", action="store_true")
    args = parser.parse_args()
    ring_copies()
    await tiny_overheads()
    if args.smollm2:
        await smollm2()


if __name__ == "__main__":
    trio.run(main)
