"""The host's cost per decode step against the number of streams, with the device out of the picture.

    .venv/bin/python bench/sched_overhead.py [--streams 1,4,8,16] [--steps 300] [--modes instant,worker]
                                             [--consumers plain,api] [--rounds 3] [--base REV] [--profile N]

Why: on the H200 a 16-column decode step is ~2 ms of GPU time; everything the host does per step that grows with
the streams (the scheduler's bookkeeping, the pipeline, the worker's codec, each stream's token handling) runs
serially between two steps, so 1 ms of it would cap 16 streams near 8x one.

Modes (each n streams of an 8-token prompt decode together; the window is the last stream's first token to the
first stream's last one, so only steps where all n decode count):
- `instant`: the Scheduler driving a LocalPipeline whose stage answers at once, in this process (one trio
  checkpoint, as the worker's reply wait; tokens a fixed function of the column): the scheduler, the pipeline and
  the consumers alone.
- `worker`: the same through a real worker process holding a tiny random model (3 layers, dim 64, CPU): the
  worker client's codec, the doorbells, the child's record decode and the stage's host side; `host` subtracts
  the child's own step time (StepDone.compute_ms) from the step's wall time.
- `core`: the scheduler's sans-IO core alone (`_Core.form` and `apply` of one decode step), no trio, no consumers.
Consumers: `plain` (each stream appends its ids) or `api` (each token detokenized and stop-checked as the HTTP API
does, `mesh/serve/openai_api._Text`, and formatted as its SSE chunk): the per-token work of a streamed answer
without hypercorn. `--sampled`: every stream samples with its own seed (the API's default, temperature 1), so
each step carries a Sampling per column.

`--model PATH --device CUDA` (worker mode): a real model on a real device instead of the tiny one on the CPU: the
step's wall time splits into the worker's own step (`child`, its stage's host side included), the parent's gap and
the rest (doorbells, the child's record decode).
`--base REV`: the same bench on git revision REV (a detached worktree in /tmp), alternating with this tree round by
round in one run: side-by-side before/after. `--ab-env VAR=VALUE`: the same, this tree with and without a setting. `--profile N`: cProfile of the first mode and consumer at N streams (the decode only), top functions.
Prints us a step and us a column (the step's host time over its columns) per row, the median of the rounds, and the
CPU time a step of each process over the all-decoding steps (`cpu par`: this process, the scheduler, pipeline and
consumers; `cpu ch`: the worker, every thread: its stage's host side and, on the CPU, the kernels with the step
runner's waits), from /proc/PID/task/*/schedstat. On a 2-core CPU box every ms of the parent's CPU is taken from the
worker's two compute threads: with `--model` (SmolLM2 on the CPU) this is where serving's own cost shows.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(args) -> dict:
    """One round of every row in this process (whichever tree PYTHONPATH points at); returns the figures."""
    sys.path.insert(0, os.environ.get("SCHED_TREE", str(ROOT)))
    import numpy as np
    import trio

    from common.values import Sampling
    from mesh.pipeline import LocalPipeline
    from mesh.scheduler import Request, Scheduler
    from mesh.serve.openai_api import _Text, _sse
    from tests.mesh_fixtures import write_tiny_chat_model
    from engine.tokenizer import Tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="sched_overhead_"))
    # with --model its own vocabulary: the tiny model copies SmolLM2's chat template, a file a device image lacks
    model = args.model if args.model else write_tiny_chat_model(tmp / "tiny.gguf", n_layers=3)
    tok = Tokenizer.from_gguf(model)
    vocab = tok.vocab_size if hasattr(tok, "vocab_size") else 256
    n_slots = max(args.streams)
    context = args.steps + 64

    class Instant:
        """A stage that answers at once: one checkpoint (the device's step, during which other tasks run), tokens a
        function of the column. Keeps when each step went out and when its answer came back."""

        def __init__(self):
            self.compute_ms, self.sent, self.received = [], [], []

        async def step(self, cols, hidden, sampling):
            self.sent.append(time.monotonic())
            await trio.lowlevel.checkpoint()
            self.received.append(time.monotonic())
            return np.array([(c.token * 7 + c.pos) % (vocab - 40) + 40 for c in cols if c.needs_logits], np.int32)

        async def zero_slot(self, slot): pass
        async def rollback(self, slot, pos): pass
        async def block_table(self, slot, blocks): pass
        async def reset(self): pass

    class Timed:
        """The worker client, keeping each step's own compute time (StepDone.compute_ms) and when its doorbell went
        out and its answer came in."""

        def __init__(self, w):
            self.w, self.compute_ms, self.sent, self.received = w, [], [], []

        def _keep(self, out):
            self.compute_ms.append(out.compute_ms)
            self.sent.append(out.sent_ms / 1e3)
            self.received.append(out.received_ms / 1e3)
            return out

        async def step(self, cols, hidden, sampling):
            return self._keep(await self.w.step_raw(cols, None, 0, 0, sampling)).array()

        def post_step_nowait(self, *a):       # a tree whose LocalPipeline posts at submit
            return self.w.post_step_nowait(*a)

        async def step_posted(self, posted):
            return self._keep(await self.w.step_posted(posted))

        def __getattr__(self, name):
            return getattr(self.w, name)

    def cpu_ns(pid: int) -> int:
        """CPU time of every thread of process pid so far, ns (/proc/PID/task/*/schedstat: time on a CPU)."""
        total = 0
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):   # a thread that ended meanwhile
                pass
        return total

    async def one(stage, n: int, consumer: str) -> dict:
        pipe = LocalPipeline(stage)
        sched = Scheduler(pipe, n_slots=n_slots, max_context=context, max_queue=n)
        times: list[list[float]] = [[] for _ in range(n)]
        # CPU of this process and of the worker over the all-decoding steps: a snapshot when the last stream has
        # its first token and one when the first stream is 2 tokens from its end (steps counted by the stage)
        pid = getattr(getattr(stage, "w", None), "pid", None)
        snaps: list[tuple[int, int, int]] = []
        firsts = [0]

        def mark(k: int) -> None:       # a stream has had k tokens
            if k == 1:
                firsts[0] += 1
            if (k == 1 and firsts[0] == n) or (k == args.steps - 2 and len(snaps) == 1):
                snaps.append((len(stage.sent), cpu_ns(os.getpid()), cpu_ns(pid) if pid else 0))

        async def consume(i: int) -> None:
            samp = Sampling(temperature=1.0, top_p=0.95, seed=1000 + i) if args.sampled else Sampling()
            req = Request(tuple(40 + (i * 13 + k) % (vocab - 40) for k in range(8)), args.steps, samp, frozenset())
            async with sched.open(req) as g:
                if consumer == "plain":
                    out = []
                    async for t in g:
                        out.append(t)
                        mark(len(out))
                else:
                    text, head = _Text(tok, ("\n\n\n\n",)), {"id": "chatcmpl-x", "object": "chat.completion.chunk",
                                                             "created": 0, "model": "m"}
                    k = 0
                    async for t in g:
                        k += 1
                        mark(k)
                        piece = text.feed(t % vocab)
                        if piece:
                            _sse({**head, "choices": [{"index": 0, "delta": {"content": piece}, "logprobs": None,
                                                       "finish_reason": None}]})
            times[i] = g.token_times

        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            for xs in (stage.compute_ms, stage.sent, stage.received):
                xs.clear()
            prof = getattr(args, "prof", None)
            if prof is not None:
                prof.enable()
            async with trio.open_nursery() as clients:
                for i in range(n):
                    clients.start_soon(consume, i)
            if prof is not None:
                prof.disable()
            nursery.cancel_scope.cancel()
        ta, tb = max(t[0] for t in times), min(t[-1] for t in times)
        steps = statistics.median(sum(1 for x in t if ta < x <= tb) for t in times)
        wall_us = (tb - ta) / steps * 1e6
        k = int(steps)
        compute = stage.compute_ms[-k:] if stage.compute_ms else []
        compute_us = statistics.mean(compute) * 1e3 if compute else 0.0
        # the parent's critical path: a step's answer in -> the next step out (the window's steps only)
        idx = [i for i in range(1, len(stage.sent)) if ta < stage.received[i - 1] <= tb]
        gap_us = statistics.median(stage.sent[i] - stage.received[i - 1] for i in idx) * 1e6 if idx else 0.0
        cpu = {}
        if len(snaps) == 2 and snaps[1][0] > snaps[0][0]:
            k = snaps[1][0] - snaps[0][0]
            cpu = {"parent_cpu_us": (snaps[1][1] - snaps[0][1]) / k / 1e3,
                   "child_cpu_us": (snaps[1][2] - snaps[0][2]) / k / 1e3}
        return {"wall_us": wall_us, "compute_us": compute_us, "host_us": wall_us - compute_us, "gap_us": gap_us, **cpu}

    def core(n: int) -> dict:
        """The sans-IO core alone: form() and apply() of a decode step of n sequences, best of 7 x 2000."""
        import timeit
        from mesh.scheduler import _Core, _Seq
        c = _Core(slots=range(n), max_queue=64, depth=1, prefill_chunk=16)
        for i in range(n):
            samp = Sampling(temperature=1.0, top_p=0.95, seed=1000 + i) if args.sampled else Sampling()
            c.enqueue(_Seq(None, Request(tuple(range(40, 48)), 10**6, samp, frozenset()), 10**6))
        c.admit()
        while True:         # every prompt prefilled, then one decode step of all n
            b = c.form()
            c.apply(b, [50] * sum(col.needs_logits for col in b.cols))
            if b.kind == "decode" and len(b.cols) == n:
                break

        def step():
            b = c.form()
            c.apply(b, [50] * len(b.cols))
        us = min(timeit.repeat(step, number=2000, repeat=7)) / 2000 * 1e6
        return {"wall_us": us, "compute_us": 0.0, "host_us": us, "gap_us": us}

    async def main() -> dict:
        res: dict = {}
        for mode in args.modes:
            if mode == "core":
                for n in args.streams:
                    res[f"core/-/{n}"] = core(n)
            elif mode == "instant":
                for consumer in args.consumers:
                    for n in args.streams:
                        res[f"{mode}/{consumer}/{n}"] = await one(Instant(), n, consumer)
            else:
                from engine.worker import open_worker
                env = dict(os.environ, MESH_TEST_SLOW_MS_PER_LAYER=str(args.device_ms / 3)) if args.device_ms \
                    else None
                path, layers = model, 3
                if args.model:          # a real model on a real device: the child's step time is printed too
                    from engine.gguf_meta import read_model_meta
                    path, layers = args.model, read_model_meta(args.model).n_layers
                async with open_worker(device=args.device, env=env) as w:
                    await w.load(path, 0, layers, n_slots=n_slots, max_context=context, warmup=n_slots)
                    stage = Timed(w)
                    await one(stage, 1, "plain")        # first steps of each shape out of the way
                    for consumer in args.consumers:
                        for n in args.streams:
                            res[f"{mode}/{consumer}/{n}"] = await one(stage, n, consumer)
        return res

    try:
        return trio.run(main)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def profile(args) -> None:
    import cProfile
    import pstats
    args.streams, args.consumers = [args.profile], args.consumers[:1]
    args.prof = pr = cProfile.Profile()
    child(args)
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def run_round(tree: Path, argv: list[str], extra: dict[str, str]) -> dict:
    from bench.ab_trees import round_env
    env = round_env(tree, extra, SCHED_TREE=str(tree))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *argv], env=env,
                         capture_output=True, text=True)
    if out.returncode:      # the round's own error, not only its exit status
        sys.exit(f"a round failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    sys.path.insert(0, str(ROOT))   # the harness's own helper; the rounds import their tree's code in the child
    from bench.ab_trees import ab_trees, alternating
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--steps", type=int, default=300, help="decode steps every stream takes")
    ap.add_argument("--modes", default="instant,worker")
    ap.add_argument("--consumers", default="plain,api")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, default=None,
                    help="worker mode: this GGUF (every layer) instead of the tiny model, e.g. on a GPU")
    ap.add_argument("--device", default="CPU", help="worker mode: the worker's device (CPU, CUDA)")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="worker mode: every step also sleeps this long in the child (a GPU step's time; the "
                         "host's work that overlaps it is hidden, what does not is counted)")
    ap.add_argument("--base", default=None, help="git revision to measure side by side with this tree")
    ap.add_argument("--sampled", action="store_true",
                    help="every stream samples with its own seed (a Sampling per column, as the API's default)")
    ap.add_argument("--ab-env", default=None, help="VAR=VALUE: this tree with that setting, side by side with it "
                                                       "without (e.g. MESH_SCHED_SERIAL=0)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the first mode and consumer at this many streams")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    raw = sys.argv[1:]
    args.streams = [int(x) for x in args.streams.split(",")]
    args.modes, args.consumers = args.modes.split(","), args.consumers.split(",")
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.profile:
        profile(args)
        return
    print(f"streams {args.streams}, {args.steps} steps, rounds {args.rounds}, cores {os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    with ab_trees(ROOT, args.base, args.ab_env, "sched_overhead") as trees:
        got: dict[str, list[dict]] = {t: [] for t in trees}
        for _, t in alternating(args.rounds, trees):
            got[t].append(run_round(trees[t][0], raw, trees[t][1]))
    keys = list(got["this"][0])
    print(f"{'row (mode/consumer/n)':<22s}" + "".join(f"{t + ': host us/step':>24s}{'/col':>7s}{'gap':>8s}{'child':>8s}"
                                                    f"{'cpu par':>8s}{'cpu ch':>8s}" for t in trees)
          + ("  this/base host, gap" if len(trees) > 1 else ""))
    for k in keys:
        n = int(k.rsplit("/", 1)[1])
        cells, meds = "", []
        for t in trees:
            host = statistics.median(x[k]["host_us"] for x in got[t])
            gap = statistics.median(x[k]["gap_us"] for x in got[t])
            child_us = statistics.median(x[k]["compute_us"] for x in got[t])
            cpu = [statistics.median(x[k].get(c, float("nan")) for x in got[t])
                   for c in ("parent_cpu_us", "child_cpu_us")]
            meds.append((host, gap))
            cells += f"{host:24.1f}{host / n:7.1f}{gap:8.1f}{child_us:8.0f}{cpu[0]:8.0f}{cpu[1]:8.0f}"
        ratio = f"  {meds[1][0] / meds[0][0]:8.2f} {meds[1][1] / meds[0][1]:5.2f}" if len(trees) > 1 else ""
        print(f"{k:<22s}{cells}{ratio}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}. host: the step's wall time over the window (worker rows: less the child's "
          f"compute_ms); gap: median time from a step's answer in to the next step out (the host's critical path); "
          f"child: the worker's own step, us (StepDone.compute_ms: its stage's step, host side included); cpu par / "
          f"cpu ch: CPU time a step of this process / of the worker process, every thread, us (the all-decoding steps)")


if __name__ == "__main__":
    main()
