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

Then, per stage, the medians over its decode steps of where a step goes inside the peer (the peers log them when
MESH_STAGE_TIMES names a directory; mesh/peer.py): receive (from the op loop taking the frame to the worker's
record posted), to device (doorbell to the child starting the step: ring and wake-up), compute (Stage.step, which
copies the input into the device buffer and the output back), from device (the child's StepDone to the client
holding it: ring and wake-up), send (frame, seal and write to the successor).
"""
from __future__ import annotations

import argparse
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
from mesh import proto  # noqa: E402
from mesh.coordinator import CoordConfig, Coordinator  # noqa: E402
from mesh.pipeline import LocalPipeline, generate  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."
ROOT = Path(__file__).resolve().parent.parent


async def warm_up(pipe, ids, n) -> list[int]:
    return (await generate(pipe, ids, max_tokens=n, sampling=Sampling(), eos_ids=frozenset())).tokens


async def lockstep(base, mesh, ids, n) -> tuple[list[float], list[float], list[int], list[int]]:
    """Prefill both, then `n` decode steps alternating base and mesh: (base step times, mesh step times, tokens of
    each). The steps are the ones generate() takes (same columns, greedy), timed one by one."""
    first = [(await generate(p, ids, max_tokens=1, sampling=Sampling(), eos_ids=frozenset())).tokens[0]
             for p in (base, mesh)]
    toks: tuple[list[int], list[int]] = ([first[0]], [first[1]])
    times: tuple[list[float], list[float]] = ([], [])
    for pos in range(len(ids), len(ids) + n - 1):
        for k, pipe in enumerate((base, mesh)):
            t0 = time.perf_counter()
            (tok,) = await pipe.step([Column(pos, 0, True, toks[k][-1])], Sampling())
            times[k].append(time.perf_counter() - t0)
            toks[k].append(int(tok))
    return times[0], times[1], toks[0], toks[1]


def _depth(model: Path) -> int:
    from engine.gguf_meta import read_model_meta
    return read_model_meta(model).n_layers


OPEN = False
TIMES_DIR = ""
PHASES = ("receive", "to device", "compute", "from device", "send")


def stage_breakdown(directory: str) -> list[tuple[tuple[int, int], int, list[float]]]:
    """Per stage (by layer range): the number of decode steps logged and the median ms of each phase."""
    rows: dict[tuple[int, int], list[list[float]]] = {}
    for f in Path(directory).glob("peer-*.txt"):
        for line in f.read_text().splitlines():
            v = line.split()
            if len(v) == 8 and v[2] == "1":          # decode steps only (one column)
                rows.setdefault((int(v[0]), int(v[1])), []).append([float(x) for x in v[3:]])
    return [(rng, len(steps), [statistics.median(s[i] for s in steps) for i in range(len(PHASES))])
            for rng, steps in sorted(rows.items())]


@asynccontextmanager
async def meshed(model: Path, peers: int, chain: str, rtc_hops: tuple[int, ...]):
    """A formed fleet of `peers` peer processes on loopback; yields its pipeline."""
    port = free_port()
    token = None if OPEN else secrets.token_urlsafe(24)     # sealed links, as a fleet runs them (--open: not)
    cfg = CoordConfig(model=model, listen=f"127.0.0.1:{port}", min_peers=peers, settle=0.3, chain=chain,
                      webrtc_hops=rtc_hops, token=token and token.encode(),
                      placement="memory")     # N equal stages on one box: the split's cost is what this measures
    coord = Coordinator(cfg)
    procs = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if TIMES_DIR:
        env["MESH_STAGE_TIMES"] = TIMES_DIR
    env.pop("MESH_TOKEN", None)
    if token:
        env["MESH_TOKEN"] = token
    try:
        async with trio.open_nursery() as nursery:
            await coord.serve_registry(nursery)
            for _ in range(peers):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "mesh", "peer", "--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                     "--model", str(model), *([] if token else ["--insecure-open"])], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True))
            async with AsyncExitStack() as stack:
                _fleet, pipe = await coord.form(nursery, stack)
                yield pipe
            nursery.cancel_scope.cancel()
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


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
    ap.add_argument("--open", action="store_true", help="open fleet (no token): links sealed with keys from the key "
                                                       "exchange alone; the default is a token, as `mesh-coord` makes")
    args = ap.parse_args()
    global OPEN
    OPEN = args.open
    model = args.model or default_model_path()
    tok = Tokenizer.from_gguf(model)
    ids = tok.encode(PROMPT)
    print(f"model {model.name}, prompt {len(ids)} tokens, {args.tokens} greedy tokens, chain {args.chain}, "
          f"{args.rounds} rounds, load {os.getloadavg()[0]:.2f}")
    global TIMES_DIR
    rows = [(f"mesh, {k} peer{'s' * (k > 1)}", k, ()) for k in map(int, args.peers.split(","))]
    if args.rtc_middle:
        rows.append(("mesh, 3 peers, hop 2 on WebRTC", 3, (2,)))
    async with open_worker() as w:
        await w.load(model, 0, _depth(model))
        local = LocalPipeline(w)
        ref = await warm_up(local, ids, args.tokens)
        print(f"{'':32s} {'tok/s':>7s} {'unsharded':>9s}   {'ratio (min..max)':>21s}   {'mean-based':>10s}")
        breakdowns = []
        for name, k, rtc in rows:
            TIMES_DIR = tempfile.mkdtemp(prefix="mesh-stage-times-")
            async with meshed(model, k, args.chain, rtc) as pipe:
                same = await warm_up(pipe, ids, args.tokens) == ref
                rounds = []
                for _ in range(args.rounds):
                    base, mesh, t_base, t_mesh = await lockstep(local, pipe, ids, args.tokens)
                    same = same and t_base == ref and t_mesh == ref
                    rounds.append((statistics.median(base) / statistics.median(mesh),
                                   statistics.fmean(base) / statistics.fmean(mesh), 1 / statistics.fmean(mesh),
                                   1 / statistics.fmean(base), statistics.median(mesh) - statistics.median(base)))
            mid = statistics.median
            ratios = sorted(r[0] for r in rounds)
            overhead_ms = mid(r[4] for r in rounds) / (k + 1) * 1e3
            per_stage_ms = mid(r[4] for r in rounds) / k * 1e3
            print(f"{name:32s} {mid(r[2] for r in rounds):7.2f} {mid(r[3] for r in rounds):9.2f}   "
                  f"{mid(ratios):.3f} ({ratios[0]:.3f}..{ratios[-1]:.3f})   {mid(r[1] for r in rounds):10.3f}   "
                  f"{overhead_ms:+.2f} ms/hop   {per_stage_ms:+.2f} ms/stage   "
                  f"{'bitwise equal' if same else 'DIFFERENT TOKENS'}", flush=True)
            breakdowns.append((name, stage_breakdown(TIMES_DIR)))
        print("per stage, medians of its decode steps in ms: " + ", ".join(PHASES))
        for name, stages in breakdowns:
            for (a, b), n, ms in stages:
                print(f"  {name:32s} layers {a:2d}..{b:2d} ({n:3d} steps)  " + "  ".join(f"{x:7.3f}" for x in ms)
                      + f"   phases other than compute {sum(ms) - ms[2]:.3f}")
    from engine.gguf_meta import read_model_meta
    p2p, sink = hop_bytes(read_model_meta(model).dim)
    print(f"bytes per token per hop: {p2p} between peers (hidden state + step), {sink} to the sink (the token); "
          f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    trio.run(main)
