"""Mesh decode speed against the unsharded engine, side by side in one run.

    .venv/bin/python bench/mesh_bench.py [--model PATH] [--tokens 64] [--peers 1,2,3] [--chain p2p] [--rtc-middle]
                                         [--rounds 3]

The unsharded engine is one worker holding every layer, driven by the same Pipeline interface as the mesh; it stays
open for the whole run. For each mesh configuration: a warm-up answer on both (compiles kernels; tinygrad caches them
on disk), then `--rounds` timed rounds. A round prefills the prompt on both, then decodes `--tokens` greedy tokens in
lockstep, one unsharded step then one mesh step, so both see the same load on a shared machine within ~0.1 s (timing
whole answers one after the other swung the ratio 0.8..1.5 under other people's tests). Columns: mesh tok/s and
unsharded tok/s (mean step time, median round), ratio = median unsharded step / median mesh step (median round,
min..max over rounds), the ratio of the mean step times (median round), and the per-hop extra of the median steps.
Peers are separate processes on loopback; the coordinator runs in this process. Per-hop overhead is the extra time per
token over the unsharded engine divided by the hops a token crosses (coordinator -> peer 1 -> ... -> peer k -> sink:
k + 1 hops); per-stage overhead (issue 10's measure) divides the same extra by the k stages.

Then, per stage, the medians over its timed decode steps of where a token goes (the peers log each step when
MESH_STAGE_TIMES names a directory, mesh/peer.py; every process of this machine stamps CLOCK_MONOTONIC, so the
bench lines a token up across them): hop in (the predecessor's write, or the coordinator's step start, to this
peer's Link reader holding the bytes: the socket and the process wake-up), decode (unseal and decode the frame), to
op (to the step starting: rung from the reader, or taken by the op loop), receive (the peer's own work from there to
the worker's record posted and from the reply to the output held), to device (doorbell to the child starting the
step: ring and wake-up), compute (Stage.step, which copies the input into the device buffer and the output back),
from device (the child's StepDone to the client holding it: ring and wake-up), to write (output held to the
forward's write starting: frame and seal), send (output held to the send returning; it overlaps the next stage).
"on the path" sums every phase but compute and send; "sink" is the last stage's write to the coordinator holding
the token. The unsharded worker's own to device, compute and from device are printed alongside.

Peers run a CPU stage in their own process by default (engine/local_stage.py): their "to device" and "from device"
are 0 and "to op" is ~0 when the step ran in the Link reader. `MESH_STAGE_IN_PEER=0 ... --ab MESH_STAGE_IN_PEER=1`
compares against worker processes, `--ab MESH_STEP_IN_READER=0` against the op loop's step. The unsharded engine is
always one worker process. The coordinator of each fleet runs in this process; `--ab MESH_HOT_SINK=0` sets its
config (CoordConfig.hot_sink: the decode loop reads the sink hop itself, Link.pump) as well as the peers' env, and
so does `--ab MESH_STEADY=0` (CoordConfig.steady, the peers' steady decode step: mesh/proto/steady.py), and
`--ab MESH_SPIN_US=N` (mesh/link.py SPIN: hot waits poll without sleeping for N us first, on a host with cores to
spare).
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sources import default_model_path  # noqa: E402
from engine.stage import Column, Sampling  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.worker import open_worker  # noqa: E402
from common import handoff  # noqa: E402
import mesh.link as link_mod  # noqa: E402
from mesh import proto  # noqa: E402
from mesh.coordinator import CoordConfig, Coordinator  # noqa: E402
from mesh.pipeline import LocalPipeline, generate  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."
ROOT = Path(__file__).resolve().parent.parent


async def warm_up(pipe, ids, n) -> list[int]:
    return (await generate(pipe, ids, max_tokens=n, sampling=Sampling(), eos_ids=frozenset())).tokens


async def lockstep(base, meshes, ids, n) -> tuple[list[list[float]], list[list[int]], list[list[tuple]]]:
    """Prefill all, then `n` decode steps alternating base and each mesh: step times and tokens of each pipe (base
    first), and each mesh's (start, end) of every timed step (CLOCK_MONOTONIC ms). The steps are the ones
    generate() takes (same columns, greedy), timed one by one."""
    pipes = (base, *meshes)
    toks = [[(await generate(p, ids, max_tokens=1, sampling=Sampling(), eos_ids=frozenset())).tokens[0]]
            for p in pipes]
    times: list[list[float]] = [[] for _ in pipes]
    spans: list[list[tuple]] = [[] for _ in meshes]
    for i, pos in enumerate(range(len(ids), len(ids) + n - 1)):
        # the base first, then the meshes in turns (the one right after the base starts with the base's caches)
        for k in (0, *(1 + (j + i) % len(meshes) for j in range(len(meshes)))):
            pipe = pipes[k]
            t0 = time.perf_counter()
            (tok,) = await pipe.step([Column(pos, 0, True, toks[k][-1])], Sampling())
            t1 = time.perf_counter()
            times[k].append(t1 - t0)
            toks[k].append(int(tok))
            if k:
                spans[k - 1].append((t0 * 1e3, t1 * 1e3))
            else:
                BASE_PHASES.append(_base_phases(base.stage))
    return times, toks, spans


def _depth(model: Path) -> int:
    from engine.gguf_meta import read_model_meta
    return read_model_meta(model).n_layers


OPEN = False
BASE_PHASES: list[list[float]] = []      # the unsharded worker's to device, compute, from device of each step


def _base_phases(w) -> list[float]:
    """The last step of worker `w`: doorbell out to the child starting, Stage.step, StepDone to the client (ms)."""
    env = w.events[-1]
    return [env.mono_ms - env.event.compute_ms - w.sent_mono_ms, env.event.compute_ms,
            w.received_mono_ms - env.mono_ms]


PHASES = ("hop in", "decode", "to op", "receive", "to device", "compute", "from device", "to write", "send")


def stage_breakdown(directory: str, steps: list[tuple[float, float]]) -> tuple[list, float]:
    """Per stage (by layer range): the number of timed decode steps logged and the median ms of each phase, and the
    median ms from the last stage's write to the coordinator holding the token (the sink hop and its turn).

    hop in = the predecessor's write (the coordinator's step start, for the first stage) to this peer's Link reader
    holding the bytes; decode = unseal and decode the frame; to op = from there to the step starting (rung by the
    reader, or taken by the op loop); the other phases come from the peer's own line (mesh/peer.py)."""
    lines = []
    for f in Path(directory).glob("peer-*.txt"):
        for line in f.read_text().splitlines():
            v = line.split()
            if len(v) == 13 and v[2] == "1":         # decode steps only (one column)
                lines.append((int(v[0]), int(v[1]), [float(x) for x in v[3:]]))
    starts = sorted(steps)
    by_step: dict[int, list] = {}
    for a, b, v in lines:
        i = bisect.bisect_right(starts, (v[6], math.inf)) - 1     # the timed step this one began in
        if i >= 0 and starts[i][0] <= v[6] <= starts[i][1]:
            by_step.setdefault(i, []).append((a, b, v))
    rows: dict[tuple[int, int], list[list[float]]] = {}
    sink = []
    for i, stages in by_step.items():
        stages.sort()
        prev_wrote = starts[i][0]
        for a, b, v in stages:
            receive, to_dev, compute, from_dev, send, arrived, began, wrote, decoded, held = v
            rows.setdefault((a, b), []).append([arrived - prev_wrote, decoded - arrived, began - decoded, receive,
                                                to_dev, compute, from_dev, wrote - held, send])
            prev_wrote = wrote
        sink.append(starts[i][1] - prev_wrote)
    return ([(rng, len(s), [statistics.median(x[i] for x in s) for i in range(len(PHASES))])
             for rng, s in sorted(rows.items())], statistics.median(sink) if sink else math.nan)


@asynccontextmanager
async def meshed(model: Path, peers: int, chain: str, rtc_hops: tuple[int, ...], times_dir: str,
                 extra_env: dict[str, str], gpus: tuple[str, ...] = ()):
    """A formed fleet of `peers` peer processes on loopback (`extra_env` in theirs); yields its pipeline. With `gpus`,
    peer i sees only GPU gpus[i % len(gpus)] (CUDA_VISIBLE_DEVICES), as peers on machines of their own would."""
    port = free_port()
    token = None if OPEN else secrets.token_urlsafe(24)     # sealed links, as a fleet runs them (--open: not)
    cfg = CoordConfig(model=model, listen=f"127.0.0.1:{port}", min_peers=peers, settle=0.3, chain=chain,
                      webrtc_hops=rtc_hops, token=token and token.encode(),
                      placement="memory",     # N equal stages on one box: the split's cost is what this measures
                      # the coordinator runs in this process: an --ab of MESH_HOT_SINK goes to its fleet's config
                      hot_sink=extra_env.get("MESH_HOT_SINK", os.environ.get("MESH_HOT_SINK", "1")) != "0",
                      steady=extra_env.get("MESH_STEADY", os.environ.get("MESH_STEADY", "1")) != "0")
    coord = Coordinator(cfg)
    procs, died, logs = [], [], [Path(times_dir) / f"peer{i}.err" for i in range(peers)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env["MESH_STAGE_TIMES"] = times_dir
    env.update(extra_env)
    env.pop("MESH_TOKEN", None)
    if token:
        env["MESH_TOKEN"] = token
    spin_before = link_mod.SPIN     # an --ab of MESH_SPIN_US goes to the coordinator (its sink's hot wait) too
    link_mod.SPIN = link_mod.spin_from_env(env)
    yield_before = handoff.YIELD     # and an --ab of MESH_WRITE_YIELD (common/handoff.py)
    handoff.YIELD = handoff.enabled(env)
    try:
        async with trio.open_nursery() as nursery:
            await coord.serve_registry(nursery)
            for i in range(peers):
                with open(logs[i], "wb") as err:   # kept: a peer that dies at start is shown, not waited for
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "mesh", "peer", "--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                         "--model", str(model), *([] if token else ["--insecure-open"])], cwd=ROOT,
                        env=dict(env, CUDA_VISIBLE_DEVICES=gpus[i % len(gpus)]) if gpus else env,
                        stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
            watching = trio.CancelScope()

            async def watch() -> None:   # a peer that dies before the fleet forms ends the wait, its stderr shown
                with watching:
                    while all(p.poll() is None for p in procs):
                        await trio.sleep(0.5)
                    died.extend(f"peer {i} (exit {p.poll()}): {logs[i].read_text(errors='replace')[-800:]}"
                                for i, p in enumerate(procs) if p.poll() is not None)
                    nursery.cancel_scope.cancel()
            nursery.start_soon(watch)
            async with AsyncExitStack() as stack:
                _fleet, pipe = await coord.form(nursery, stack)
                watching.cancel()
                pipe.peer_pids = [p.pid for p in procs]
                yield pipe
            # a peer writes its last stage-time lines when its session ends, then joins the pool again: wait for
            # that (bounded) before the processes are killed
            with trio.move_on_after(5):
                while not all(p.poll() is not None or logs[i].read_text(errors="replace").count("joined coordinator")
                              > 1 for i, p in enumerate(procs)):
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        if died:
            raise SystemExit("mesh_bench: a peer died before the fleet formed" + "".join(f"\n  {d}" for d in died))
    finally:
        link_mod.SPIN = spin_before
        handoff.YIELD = yield_before
        for p in procs:
            with contextlib.suppress(ProcessLookupError):   # a peer that died alone left no group
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def cpu_times(pids: list[int], children: bool = True) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (thread name, user + system CPU seconds) of every thread of these processes and, with
    `children`, of their children (a peer's worker): per-thread accounting of who burns the cores around a token."""
    import psutil
    out = {}
    for pid in pids:
        try:
            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True) if children else []
        except psutil.Error:
            continue
        for proc in procs:
            try:
                for t in proc.threads():
                    try:
                        name = Path(f"/proc/{proc.pid}/task/{t.id}/comm").read_text().strip()
                    except OSError:
                        name = "?"
                    kind = "main" if t.id == proc.pid else name
                    role = "worker" if proc.pid != pid or "worker_main" in " ".join(proc.cmdline()) else "peer"
                    out[(proc.pid, t.id)] = (f"{role} {kind}", t.user_time + t.system_time)
            except psutil.Error:
                continue
    return out


def cpu_per_token(before, after, steps: int) -> dict[str, float]:
    """ms of CPU per timed decode step by thread role, summed over the threads of that role."""
    per: dict[str, float] = {}
    for key, (name, t) in after.items():
        t0 = before.get(key, (name, 0.0))[1]
        # other threads than the main one: the CPU runner's helpers (in a worker, or in a peer that runs its stage
        # itself, where they are named after the trio thread that started them) and trio's thread cache
        role = f"{name.split()[0]} helpers" if not name.endswith(" main") else name
        per[role] = per.get(role, 0.0) + (t - t0) * 1e3 / steps
    return per


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hop_bytes(dim: int) -> tuple[int, int]:
    """Encoded frame sizes of one decode token: a peer-to-peer hop (step + hidden state) and the sink hop (token)."""
    codec = proto.Codec()
    step = proto.BatchStep(1, False, (proto.Column(100, 0, True, 42),),
                           proto.Activation("f32", (1, dim), bytes(4 * dim)), proto.SamplingParams())
    done = proto.Done(1, (42,))
    return len(codec.send(step)), len(codec.send(done))


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--peers", default="1,2,3")
    ap.add_argument("--chain", default="p2p")
    ap.add_argument("--rounds", type=int, default=3, help="timed (unsharded, mesh) answer pairs per configuration")
    ap.add_argument("--rtc-middle", action="store_true", help="also run 3 peers with the middle hop on WebRTC")
    ap.add_argument("--ab", default="", metavar="VAR=VALUE[,VAR=VALUE]",
                    help="also run each configuration with VAR=VALUE in its peers' environment, in the same lockstep "
                         "rounds (base, mesh, mesh with VAR): an A/B of one change on a shared machine; "
                         "MESH_RAW_STEP=0,MESH_HOT_WAIT=0 runs the peers' hot path as before the sixth session")
    ap.add_argument("--gpus", default="", help="comma list of GPU indices: peer i sees only the i-th (modulo), "
                    "CUDA_VISIBLE_DEVICES; the unsharded engine keeps this process's (e.g. --gpus 1,2,3 on a 4-GPU "
                    "host: every stage and the unsharded engine on a GPU of its own)")
    ap.add_argument("--open", action="store_true", help="open fleet (no token): links sealed with keys from the key "
                                                       "exchange alone; the default is a token, as `mesh-coord` makes")
    args = ap.parse_args()
    global OPEN
    OPEN = args.open
    model = args.model or default_model_path()
    gpus = tuple(g for g in args.gpus.split(",") if g)
    tok = Tokenizer.from_gguf(model)
    ids = tok.encode(PROMPT)
    print(f"model {model.name}, prompt {len(ids)} tokens, {args.tokens} greedy tokens, chain {args.chain}, "
          f"{args.rounds} rounds, load {os.getloadavg()[0]:.2f}"
          + (f", peers on GPUs {','.join(gpus)}" if gpus else ""))
    rows = [(f"mesh, {k} peer{'s' * (k > 1)}", k, ()) for k in map(int, args.peers.split(","))]
    if args.rtc_middle:
        rows.append(("mesh, 3 peers, hop 2 on WebRTC", 3, (2,)))
    variants = [("", {})]
    if args.ab:     # VAR=VALUE, or several: A=1,B=0
        variants.append((f" [{args.ab}]", dict(kv.partition("=")[::2] for kv in args.ab.split(","))))
    async with open_worker() as w:
        await w.load(model, 0, _depth(model))
        local = LocalPipeline(w)
        ref = await warm_up(local, ids, args.tokens)
        print(f"{'':44s} {'tok/s':>7s} {'unsharded':>9s}   {'ratio (min..max)':>21s}   {'mean-based':>10s}")
        breakdowns = []
        for name, k, rtc in rows:
            dirs = [tempfile.mkdtemp(prefix="mesh-stage-times-") for _ in variants]
            async with AsyncExitStack() as fleets:
                pipes = [await fleets.enter_async_context(meshed(model, k, args.chain, rtc, d, env, gpus))
                         for d, (_, env) in zip(dirs, variants)]
                same = [await warm_up(p, ids, args.tokens) == ref for p in pipes]
                rounds: list[list[tuple]] = [[] for _ in pipes]
                spans: list[list[tuple]] = [[] for _ in pipes]
                watched = [[os.getpid()], [w.pid], *[p.peer_pids for p in pipes]]
                cpu_before = [cpu_times(pids, k > 0) for k, pids in enumerate(watched)]
                for _ in range(args.rounds):
                    times, toks, steps = await lockstep(local, pipes, ids, args.tokens)
                    base = times[0]
                    for v, mesh in enumerate(times[1:]):
                        same[v] = same[v] and toks[0] == ref and toks[v + 1] == ref
                        spans[v] += steps[v]
                        rounds[v].append((statistics.median(base) / statistics.median(mesh),
                                          statistics.fmean(base) / statistics.fmean(mesh), 1 / statistics.fmean(mesh),
                                          1 / statistics.fmean(base), statistics.median(mesh) - statistics.median(base)))
                steps = args.rounds * (args.tokens - 1)
                cpu = [cpu_per_token(b, cpu_times(pids, k > 0), steps) for k, (b, pids) in enumerate(zip(cpu_before, watched))]
            mid = statistics.median
            print(f"  CPU per timed step, ms (all threads of a role): this process (coordinator, unsharded client) "
                  f"{sum(cpu[0].values()):.2f}; unsharded worker "
                  + ", ".join(f"{r} {t:.2f}" for r, t in sorted(cpu[1].items())))
            for v, (suffix, _) in enumerate(variants):
                print(f"  {name + suffix}: its peers together: "
                      + ", ".join(f"{r} {t:.2f}" for r, t in sorted(cpu[2 + v].items())))
            for v, (suffix, _) in enumerate(variants):
                ratios = sorted(r[0] for r in rounds[v])
                overhead_ms = mid(r[4] for r in rounds[v]) / (k + 1) * 1e3
                per_stage_ms = mid(r[4] for r in rounds[v]) / k * 1e3
                print(f"{name + suffix:44s} {mid(r[2] for r in rounds[v]):7.2f} {mid(r[3] for r in rounds[v]):9.2f}   "
                      f"{mid(ratios):.3f} ({ratios[0]:.3f}..{ratios[-1]:.3f})   {mid(r[1] for r in rounds[v]):10.3f}   "
                      f"{overhead_ms:+.2f} ms/hop   {per_stage_ms:+.2f} ms/stage   "
                      f"{'bitwise equal' if same[v] else 'DIFFERENT TOKENS'}", flush=True)
                breakdowns.append((name + suffix, *stage_breakdown(dirs[v], spans[v])))
        print("per stage, medians of its timed decode steps in ms: " + ", ".join(PHASES))
        base_ms = [statistics.median(p[i] for p in BASE_PHASES) for i in range(3)]
        print(f"  {'unsharded (one worker)':44s} all layers   ({len(BASE_PHASES):3d} steps)  " + "  ".join(
            f"{'':7s}" for _ in range(4)) + "  " + "  ".join(f"{x:7.3f}" for x in base_ms))
        print("  (on the token's path: every phase but compute and send; send overlaps the next stage)")
        for name, stages, sink in breakdowns:
            for (a, b), n, ms in stages:
                print(f"  {name:44s} layers {a:2d}..{b:2d} ({n:3d} steps)  " + "  ".join(f"{x:7.3f}" for x in ms)
                      + f"   on the path {sum(ms) - ms[5] - ms[8]:.3f}")
            print(f"  {name:44s} sink: last stage's write to the coordinator holding the token {sink:7.3f}")
    from engine.gguf_meta import read_model_meta
    p2p, sink = hop_bytes(read_model_meta(model).dim)
    print(f"bytes per token per hop: {p2p} between peers (hidden state + step), {sink} to the sink (the token); "
          f"load {os.getloadavg()[0]:.2f}")


def _exit_of(group: BaseExceptionGroup) -> SystemExit | None:
    """The first SystemExit inside trio's nursery groups (a bench's own one-line failure), if any."""
    for e in group.exceptions:
        found = _exit_of(e) if isinstance(e, BaseExceptionGroup) else e if isinstance(e, SystemExit) else None
        if found is not None:
            return found
    return None


if __name__ == "__main__":
    try:
        trio.run(main)
    except BaseExceptionGroup as group:
        if (exit_ := _exit_of(group)) is None:
            raise
        sys.exit(exit_.code)
