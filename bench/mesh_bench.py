"""Mesh decode speed against the unsharded engine, side by side in one run.

    .venv/bin/python bench/mesh_bench.py [--model PATH] [--tokens 64] [--peers 1,2,3] [--chain p2p] [--rtc-middle]

For each configuration: a warm-up answer (compiles kernels; tinygrad caches them on disk), then a timed answer.
Decode tok/s counts from the first generated token to the last. The unsharded engine is one worker holding every
layer, driven by the same generate() as the mesh. Peers are separate processes on loopback; the coordinator runs in
this process. Per-hop overhead is the extra time per token over the unsharded engine divided by the hops a token
crosses (coordinator -> peer 1 -> ... -> peer k -> sink: k + 1 hops).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sources import default_model_path  # noqa: E402
from engine.stage import Sampling  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.worker import open_worker  # noqa: E402
from mesh import proto  # noqa: E402
from mesh.coordinator import CoordConfig, Coordinator  # noqa: E402
from mesh.pipeline import LocalPipeline, generate  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."
ROOT = Path(__file__).resolve().parent.parent


async def timed(pipe, ids, tok, n) -> tuple[float, list[int]]:
    stamps: list[float] = []
    result = await generate(pipe, ids, max_tokens=n, sampling=Sampling(), eos_ids=frozenset(),
                            on_token=lambda _t: stamps.append(time.perf_counter()))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), result.tokens


async def unsharded(model: Path, ids, tok, n) -> tuple[float, list[int]]:
    async with open_worker() as w:
        await w.load(model, 0, _depth(model))
        pipe = LocalPipeline(w)
        await timed(pipe, ids, tok, n)                     # warm-up
        return await timed(pipe, ids, tok, n)


def _depth(model: Path) -> int:
    from engine.gguf_meta import read_model_meta
    return read_model_meta(model).n_layers


async def meshed(model: Path, ids, tok, n, peers: int, chain: str, rtc_hops: tuple[int, ...]) -> tuple[float, list[int]]:
    port = free_port()
    cfg = CoordConfig(model=model, listen=f"127.0.0.1:{port}", min_peers=peers, settle=0.3, chain=chain,
                      webrtc_hops=rtc_hops)
    coord = Coordinator(cfg)
    procs = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    try:
        async with trio.open_nursery() as nursery:
            await coord.serve_registry(nursery)
            for _ in range(peers):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "mesh", "peer", "--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                     "--model", str(model)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True))
            async with AsyncExitStack() as stack:
                _fleet, pipe = await coord.form(nursery, stack)
                await timed(pipe, ids, tok, n)             # warm-up
                result = await timed(pipe, ids, tok, n)
            nursery.cancel_scope.cancel()
        return result
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
    ap.add_argument("--rtc-middle", action="store_true", help="also run 3 peers with the middle hop on WebRTC")
    args = ap.parse_args()
    model = args.model or default_model_path()
    tok = Tokenizer.from_gguf(model)
    ids = tok.encode(PROMPT)
    print(f"model {model.name}, prompt {len(ids)} tokens, {args.tokens} greedy tokens, chain {args.chain}")
    base, ref = await unsharded(model, ids, tok, args.tokens)
    print(f"{'unsharded engine':32s} {base:8.2f} tok/s   1.000")
    rows = [(f"mesh, {k} peer{'s' * (k > 1)}", k, ()) for k in map(int, args.peers.split(","))]
    if args.rtc_middle:
        rows.append(("mesh, 3 peers, hop 2 on WebRTC", 3, (2,)))
    for name, k, rtc in rows:
        rate, toks = await meshed(model, ids, tok, args.tokens, k, args.chain, rtc)
        hops = k + 1
        overhead_ms = (1 / rate - 1 / base) / hops * 1e3
        same = "bitwise equal" if toks == ref else "DIFFERENT TOKENS"
        print(f"{name:32s} {rate:8.2f} tok/s   {rate / base:.3f}   {overhead_ms:+.2f} ms/hop   {same}")
    from engine.gguf_meta import read_model_meta
    p2p, sink = hop_bytes(read_model_meta(model).dim)
    print(f"bytes per token per hop: {p2p} between peers (hidden state + step), {sink} to the sink (the token)")


if __name__ == "__main__":
    trio.run(main)
