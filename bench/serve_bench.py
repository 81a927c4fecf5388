"""Serving many users at once: the scheduler's aggregate decode speed against one stream, side by side in one run.

    .venv/bin/python bench/serve_bench.py [--model PATH] [--streams 1,4,8,16] [--tokens 48] [--modes local,chain]
                                          [--split 12,12,6] [--sampled] [--rounds 1]

For each mode (`local`: one worker holding every layer; `chain`: a coordinator and 3 peers wired peer to peer on
loopback, the peers in this process with their stages in worker processes, so their busy time can be read) and each
number of streams n: n greedy requests with different chat prompts arrive at once; each asks for enough tokens that
all n decode together for at least `--tokens` steps after the last one's prompt is in. Columns:
- aggregate decode tok/s: tokens emitted while all n streams decode (from the last stream's first token to the first
  stream's last token), over that window; `x1` = that against the one-stream row of the same mode;
- per-stream tok/s: the median stream's tokens in that window over the window;
- TTFT p50 / p95: arrival to first token, over the n streams (the prompts queue behind each other: under load);
- busy (chain): the fraction of the window each stage spent computing a step (lock, worker step, forward send),
  from the peers' own step records; the pipeline's bubble is 1 minus that.
`--split`: the chain's layers per stage (the peers pinned to them; default: the coordinator's memory placement,
equal layers), the output head on the last. `--sampled`: every stream samples (temperature 0.8, top_p 0.95, its own
seed) instead of decoding greedily. `--rounds R`: every row R times, in ascending order of streams then
descending (1, 8, 8, 1, 1, 8, ...), with one summary line per row: the median aggregate and its ratio to the
one-stream median, and the range of the ratios of the same round's rows (on a shared box the load moves within a
minute; a single round's ratio can land anywhere from 2.5x to 5x, a median of alternated rounds far less). A lone
stream decodes one column a step (the matvec; no companion column since 2026-12-02: the matvec sums in the GEMM's
order). Tokens are checked: every stream of every row must equal the same prompt run alone in that mode.

`--base REV` (a detached worktree of git revision REV in /tmp) or `--ab-env VAR=VALUE` (this tree with that setting):
the bench for that tree and for this one, each round a fresh process of one round, the two alternating (base, this,
this, base, ...); then per tree the median aggregate of each row, its ratio to the one-stream median, and each
round's ratio. Why: this 2-core VM's speed drifts by more than a change of a few percent within minutes (one stream
5.96-7.60 ms a step in six runs over 76 s, bench/RESULTS.md "Tenth session"), so two trees are compared only in
alternating rounds of one command.
"""
from __future__ import annotations

import argparse
import math
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections import deque
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ab_trees import ab_trees, alternating, round_env  # noqa: E402
from engine.chat import render_prompt  # noqa: E402
from engine.gguf_meta import read_model_meta  # noqa: E402
from engine.sources import default_model_path  # noqa: E402
from common.values import Sampling  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.worker import open_worker  # noqa: E402
from mesh.coordinator import CoordConfig, Coordinator  # noqa: E402
from mesh.peer import Peer, PeerConfig  # noqa: E402
from mesh.pipeline import LocalPipeline  # noqa: E402
from mesh.scheduler import Request, Scheduler  # noqa: E402

TOPICS = ["a robot who learns to paint", "the history of bread", "why the sky is blue", "a lighthouse keeper",
          "how bees make honey", "a city under the sea", "the first snow of winter", "a dragon who is afraid",
          "how trains changed travel", "a garden on the moon", "the life of a river", "a clock that runs backward",
          "how volcanoes form", "a cat who runs a bakery", "the northern lights", "a library with no books"]
CONTEXT = 512


def prompts(tok: Tokenizer, n: int) -> list[tuple[int, ...]]:
    return [tuple(tok.encode(render_prompt(tok, f"Write a short story about {TOPICS[i % len(TOPICS)]}.",
                                           mode="auto"))) for i in range(n)]


@asynccontextmanager
async def local_pipe(model: Path, n_slots: int, warmup: int):
    async with open_worker() as w:
        await w.load(model, 0, read_model_meta(model).n_layers, n_slots=n_slots, max_context=CONTEXT, warmup=warmup)
        yield LocalPipeline(w), []


@asynccontextmanager
async def chain_pipe(model: Path, n_slots: int, warmup: int, peers: int = 3, split: list[int] | None = None):
    token = secrets.token_urlsafe(24).encode()
    cfg = CoordConfig(model=model, listen="127.0.0.1:0", token=token, min_peers=peers, settle=0.3, wait=600,
                      n_slots=n_slots, max_context=CONTEXT, stage_warmup=warmup,   # Load gives every peer these
                      placement="memory")   # 3 equal stages: by speed, peers of one box become one stage (GPU)
    async with trio.open_nursery() as nursery:
        coord = Coordinator(cfg)
        port = await coord.serve_registry(nursery)
        members, cuts = [], [0]
        for n in split or []:
            cuts.append(cuts[-1] + n)
        for i in range(peers):
            # --split: each peer pinned to its range, loaded at start with the session's shapes (no reload)
            pin = dict(layers=(cuts[i], cuts[i + 1]), n_slots=n_slots, max_context=CONTEXT, warmup=warmup) if split else {}
            p = Peer(PeerConfig(join=f"127.0.0.1:{port}", token=token, listen="127.0.0.1:0", model=model,
                                report_every=3600, **pin))
            p.report.window = deque(maxlen=1_000_000)    # every step's busy time, not the last 256
            members.append(p)
            nursery.start_soon(p.run)
        async with AsyncExitStack() as stack:
            _, pipe = await coord.form(nursery, stack)
            stages = sorted(members, key=lambda p: p.loaded[0])
            yield pipe, stages
        nursery.cancel_scope.cancel()


async def run_streams(pipe, reqs: list[Request], n_slots: int, **kw) -> dict:
    sched = Scheduler(pipe, n_slots=n_slots, max_context=CONTEXT, max_queue=len(reqs), **kw)
    times: list[list[float]] = [[] for _ in reqs]
    toks: list[list[int]] = [[] for _ in reqs]

    async def consume(i: int) -> None:
        async with sched.open(reqs[i]) as g:
            async for t in g:
                toks[i].append(t)
        times[i] = g.token_times          # when the scheduler handed each token over

    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        t0 = time.monotonic()
        async with trio.open_nursery() as clients:
            for i in range(len(reqs)):
                clients.start_soon(consume, i)
        nursery.cancel_scope.cancel()
    ta, tb = max(t[0] for t in times), min(t[-1] for t in times)
    if len(reqs) == 1:
        ta = times[0][1]          # one stream: its decode steps only
    in_window = [sum(1 for x in t if ta < x <= tb) for t in times]
    span = tb - ta
    return {"t0": t0, "ta": ta, "tb": tb, "tokens": toks, "agg": sum(in_window) / span if span > 0 else float("nan"),
            "per": statistics.median(in_window) / span if span > 0 else float("nan"),
            "ttft": sorted(t[0] - t0 for t in times), "steps": sched.stats().steps}


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def busy(stages, ta: float, tb: float) -> str:
    if not stages or tb <= ta:
        return ""
    fr = [sum(b for t, _, b in p.report.window if ta < t <= tb) / (tb - ta) for p in stages]
    return " ".join(f"{f:.2f}" for f in fr)


def side_by_side(args, argv: list[str]) -> None:
    """--base / --ab-env: alternating rounds of this bench as child processes of one round each (see the docstring)."""
    root = Path(__file__).resolve().parent.parent
    skip = {"--base", "--ab-env", "--rounds"}
    rest = [a for i, a in enumerate(argv) if a not in skip and (i == 0 or argv[i - 1] not in skip)
            and not a.startswith(("--base=", "--ab-env=", "--rounds="))]
    with ab_trees(root, args.base, args.ab_env, "serve_bench") as trees:
        print(f"{' / '.join(trees)}: {args.rounds} alternating rounds of `serve_bench.py {' '.join(rest)}`, "
              f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}", flush=True)
        got: dict[str, list[dict]] = {t: [] for t in trees}
        for r, t in alternating(args.rounds, trees):
            tree, extra = trees[t]
            out = subprocess.run([sys.executable, str(tree / "bench" / "serve_bench.py"), *rest, "--rounds", "1"],
                                 env=round_env(tree, extra), capture_output=True, text=True)
            rows = [ln for ln in out.stdout.splitlines() if ln.strip()[:1].isdigit() and "load" in ln]
            if out.returncode or not rows:
                sys.exit(f"{t}, round {r + 1} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            # a row: streams, agg tok/s, x1, per-stream, TTFT p50, p95, [busy ...], equal alone / DIFFERENT
            res = {int(ln.split()[0]): (float(ln.split()[1]), "DIFFERENT" not in ln) for ln in rows}
            got[t].append(res)
            print(f"  round {r + 1} {t:>24s}: " + "  ".join(f"{n}: {a:.2f}" for n, (a, _) in sorted(res.items()))
                  + ("" if all(ok for _, ok in res.values()) else "  DIFFERENT") + f"  load {os.getloadavg()[0]:.2f}",
                  flush=True)
    for t, rounds in got.items():
        counts = sorted(rounds[0])
        med = {n: statistics.median(x[n][0] for x in rounds) for n in counts}
        line = "  ".join(f"{n}: {med[n]:.2f}" + (f" ({med[n] / med[1]:.2f}x, rounds "
                                                  f"{min(x[n][0] / x[1][0] for x in rounds):.2f}.."
                                                  f"{max(x[n][0] / x[1][0] for x in rounds):.2f})" if 1 in med and n != 1
                                                  else "") for n in counts)
        print(f"{t:>24s} medians: {line}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}", flush=True)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=48, help="decode steps every stream takes while all decode")
    ap.add_argument("--modes", default="local,chain")
    ap.add_argument("--split", default=None,
                    help="chain: layers per stage, e.g. 16,13,1 (default: the coordinator's memory placement, equal "
                         "layers); the last stage also holds the output head")
    ap.add_argument("--sampled", action="store_true",
                    help="sample (temperature 0.8, top_p 0.95, a seed per stream) instead of greedy decoding")
    ap.add_argument("--rounds", type=int, default=1,
                    help="every row this many times, alternating the order; prints medians and the per-round ratios")
    ap.add_argument("--base", default=None, help="git revision to run side by side with this tree, rounds alternating")
    ap.add_argument("--ab-env", default=None, help="VAR=VALUE[,VAR=VALUE]: this tree with and without them, rounds alternating")
    args = ap.parse_args()
    if args.base or args.ab_env:
        if "," in args.modes:
            ap.error("--base / --ab-env compare one mode: give --modes local or --modes chain")
        side_by_side(args, sys.argv[1:])
        return
    split = [int(x) for x in args.split.split(",")] if args.split else None
    if split and sum(split) != read_model_meta(args.model or default_model_path()).n_layers:
        ap.error(f"--split {args.split} does not add up to the model's layers")
    model = args.model or default_model_path()
    tok = Tokenizer.from_gguf(model)
    counts = [int(x) for x in args.streams.split(",")]
    n_slots = max(counts)
    sampling = (lambda i: Sampling(temperature=0.8, top_p=0.95, seed=1000 + i)) if args.sampled else \
        (lambda i: Sampling())
    print(f"model {model.name}, streams {counts}, >= {args.tokens} decode steps together, context {CONTEXT}, "
          f"{'sampled' if args.sampled else 'greedy'}, cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}", flush=True)
    for mode in args.modes.split(","):
        stages_n = 1 if mode == "local" else 3
        widths = math.ceil(max(counts) / stages_n)      # the widest decode batch the scheduler forms
        opener = local_pipe if mode == "local" else partial(chain_pipe, split=split)
        t_load = time.monotonic()
        async with opener(model, n_slots, widths) as (pipe, stages):
            layers = " + ".join(f"{p.loaded[0]}..{p.loaded[1]}" for p in stages)
            print(f"\n{mode}: {stages_n} stage(s){' (layers ' + layers + ', the head on the last)' if stages else ''}, "
                  f"decode widths 1..{widths} compiled at load ({time.monotonic() - t_load:.0f} s with the fleet)",
                  flush=True)
            print(f"{'streams':>16s} {'agg tok/s':>9s} {'x1':>6s} {'per-stream':>10s} {'TTFT p50':>9s} "
                  f"{'p95':>7s}  {'busy per stage':<16s} tokens", flush=True)
            all_ids = prompts(tok, max(counts))
            need = args.tokens + sum(math.ceil(len(p) / 16) for p in all_ids) + 1
            alone: dict[int, list[int]] = {}
            one = None
            aggs: dict[int, list[float]] = {n: [] for n in counts}
            for rnd in range(args.rounds):
                for n in (counts if rnd % 2 == 0 else counts[::-1]):
                    ids = all_ids[:n]
                    chunks = sum(math.ceil(len(p) / 16) for p in ids)
                    reqs = [Request(p, args.tokens + chunks + 1, sampling(i), frozenset()) for i, p in enumerate(ids)]
                    r = await run_streams(pipe, reqs, n_slots)
                    for i, out in enumerate(r["tokens"]):      # each stream against its prompt alone (this mode)
                        if i not in alone:
                            alone[i] = (await run_streams(pipe, [Request(ids[i], need, sampling(i), frozenset())],
                                                          n_slots))["tokens"][0]
                    same = all(out == alone[i][:len(out)] for i, out in enumerate(r["tokens"]))
                    aggs[n].append(r["agg"])
                    if n == 1:
                        one = r["agg"]
                    x1 = f"{r['agg'] / one:6.2f}" if one else "     -"
                    tag = f"{n}" if args.rounds == 1 else f"{n} (round {rnd + 1})"
                    print(f"{tag:>16s} {r['agg']:9.2f} {x1} {r['per']:10.2f} {pct(r['ttft'], .5):8.2f}s "
                          f"{pct(r['ttft'], .95):6.2f}s  {busy(stages, r['ta'], r['tb']):<16s} "
                          f"{'equal alone' if same else 'DIFFERENT'}  load {os.getloadavg()[0]:.1f}", flush=True)
            if args.rounds > 1 and 1 in aggs:
                m1 = statistics.median(aggs[1])
                print(f"medians of {args.rounds} rounds (ratio range: each round's row against that round's one "
                      f"stream):")
                for n in counts:
                    ratios = [a / b for a, b in zip(aggs[n], aggs[1])]
                    print(f"{n:>16d} {statistics.median(aggs[n]):9.2f} {statistics.median(aggs[n]) / m1:6.2f}  "
                          f"per-round x1 {min(ratios):.2f}..{max(ratios):.2f} (median {statistics.median(ratios):.2f})",
                          flush=True)
    print(f"\nload {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    trio.run(main)
