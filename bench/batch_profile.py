"""Where a batched decode step spends its time against one column's step, kernel by kernel (issue 11, CPU).

    .venv/bin/python bench/batch_profile.py [--model PATH] [--width 8] [--rounds 20] [--prompt 20] [--mixed]

Loads the whole model in this process (one Stage, the serving shapes: n_slots = width, context 512), prefills
`width` slots with `--prompt` tokens each (20), then:
1. times, alternating, a decode step of one column and one of `width` columns (one per slot): medians, the
   ratio, and what `width` streams could reach against one stream from the engine alone (width x t1 / tN);
2. per kernel kind (a GEMM/matvec by its weight's shape, attention, norms), its time in each step: every kernel of
   the captured step is run alone, 10 times in a row, on the step runner's threads (so a weight that fits the
   cache is warm: the kernel's compute, not the step's memory traffic); then the captured step's kernels all in
   order on the same runner, without the Stage's Python (each weight read once, as in the step): the step minus
   this is Python and the hand-off around the runner, this minus the kernels alone is the weights' memory traffic
   and the waits between kernels;
3. with `--mixed`: a step holding one sequence's prefill chunk (16 columns) beside `width` decode columns, against
   the chunk and the decode step apart: what computing a prompt chunk in the same step as the decode columns
   would save on this CPU (the scheduler alternates them; NOTES "Scheduler"). The mixed shape is compiled on
   first use (not part of the warmup).
Figures are CPU time on a shared box: note the load printed at the start and end.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cpu_runner import StepRunner  # noqa: E402
from engine.gguf_meta import read_model_meta  # noqa: E402
from engine.sources import default_model_path  # noqa: E402
from engine.stage import Column, Sampling, Stage  # noqa: E402

CONTEXT, PROMPT, REPS = 512, 20, 10


def kind(name: str) -> str:
    """A kernel's kind: a matmul by its weight (the matvec mv_q4_1_192x16_18, the GEMM mm_q4_1_192x16_18_t8 and the
    8-bit-activation i8_q4_1_192x16_18_n8 are all "q4_1 3072 rows"), others by their op (attn_scores_8x9x64 ->
    attn_scores)."""
    parts = name.split("_")
    if parts[0] == "q8x":  # x quantized to 8 bits before an 8-bit-activation matmul (engine/quant_i8.py)
        return "quantize x"
    if parts[0] in ("mm", "mv", "i8"):
        groups, il = parts[3].split("x")
        return f"{parts[1]}_{parts[2]} {int(groups) * int(il)} rows"
    if parts[0] in ("attn", "kv", "rms"):
        return "_".join(parts[:2])
    return parts[0] if parts[0] == "glu" else "other"


def _captured(st: Stage, width: int):
    """The decode step of `width` columns (slot i in column i): its replay and its captured calls."""
    shape = next(k for k in st._replays if k[0] == width and len(k[1]) == width)
    return st._replays[shape], st._jits[shape].captured.linear.src


def _var_vals(st: Stage, width: int, pos: int) -> dict:
    """The step's bound variables: slot i at `pos` in column i, the context, greedy picks."""
    var_vals = {st._vctx.expr: pos + 1, **{f"pick{j}": j for j in range(width)}}
    for i in range(width):
        var_vals[st._vslot[i].expr], var_vals[st._vpos[i].expr] = i, pos
    return var_vals


def kernel_times(st: Stage, width: int, pos: int) -> dict[str, tuple[float, int]]:
    """Kernel kind -> (seconds per step, calls per step) for the decode step of `width` columns at `pos`."""
    replay, calls = _captured(st, width)
    var_vals = _var_vals(st, width, pos)
    by_kind: dict[str, list] = collections.defaultdict(list)
    for call, c in zip(calls, replay.calls):
        by_kind[kind(call.src[0].arg.name)].append((call.src[0].arg.name, c))
    out = {}
    for k, members in by_kind.items():
        total = 0.0
        for name in sorted({n for n, _ in members}):    # each distinct kernel once, times its number of calls
            same = [c for n, c in members if n == name]
            runner = StepRunner([same[0]] * REPS, replay.threads)
            vals = {v: var_vals[v] for v in runner.slots}
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                runner.run(vals)
                ts.append((time.perf_counter() - t) / REPS)
            total += statistics.median(ts) * len(same)
        out[k] = (total, len(members))
    return out


def _runner(st: Stage, width: int, pos: int, drop: str | None = None):
    """The captured decode step of `width` columns as a step runner (less the kernels of kind `drop`) and the
    values of its variables."""
    replay, calls = _captured(st, width)
    var_vals = _var_vals(st, width, pos)
    kept = [c for call, c in zip(calls, replay.calls) if drop is None or kind(call.src[0].arg.name) != drop]
    runner = StepRunner(kept, replay.threads)
    return runner, {v: var_vals[v] for v in runner.slots}


def _time(runner: StepRunner, vals: dict, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        runner.run(vals)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def runner_time(st: Stage, width: int, pos: int) -> float:
    """Seconds of the captured decode step of `width` columns run by the step runner alone (median of 20)."""
    return _time(*_runner(st, width, pos), 20)


def knockout(st: Stage, width: int, pos: int, kinds: list[str], rounds: int) -> dict[str, float]:
    """Kernel kind -> seconds the whole step (runner alone) loses without that kind's kernels: its cost inside the
    step, its memory traffic and waits included (the kernels after it read stale values: timing only). Whole and
    knocked-out runners alternate, medians of `rounds` differences."""
    whole = _runner(st, width, pos)
    outs = {}
    for k in kinds:
        less = _runner(st, width, pos, drop=k)
        diffs = []
        for _ in range(rounds):
            diffs.append(_time(*whole, 3) - _time(*less, 3))
        outs[k] = statistics.median(diffs)
    return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--kv", default=None, choices=["f32", "f16"], help="the KV pools' type (default: the engine's, "
                    "f16 on the CPU; the fourteenth session's tables pass f32 to compare with older trees)")
    ap.add_argument("--knockout", type=int, default=0, metavar="ROUNDS", help="also each kernel kind's cost inside "
                    "the step: the runner with and without that kind's kernels, alternating")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="tokens each slot holds before the timed steps "
                    "(serve_bench's streams decode at positions ~40-100)")
    args = ap.parse_args()
    model = args.model or default_model_path()
    W = args.width
    print(f"model {model.name}, decode width {W}, cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}", flush=True)
    st = Stage.load(model, 0, read_model_meta(model).n_layers, n_slots=W + 1, max_context=CONTEXT,
                    kv_dtype=args.kv)
    st.warmup(decode_batch=W)
    greedy = Sampling()
    for s in range(W + 1):
        for c in range(0, args.prompt, 64):
            st.step([Column(i, s, i == args.prompt - 1, 1 + i + s) for i in range(c, min(c + 64, args.prompt))],
                    None, greedy)
    pos = args.prompt
    times: dict[str, list[float]] = collections.defaultdict(list)

    def timed(tag: str, cols: list[Column]) -> None:
        t = time.perf_counter()
        st.step(cols, None, greedy)
        times[tag].append(time.perf_counter() - t)

    for r in range(args.rounds):    # slot s decodes position pos in both steps: the same work, the same KV length
        for w in ((1, W) if r % 2 else (W, 1)):
            timed(str(w), [Column(pos, s, True, 5 + s) for s in range(w)])
        pos += 1
    t1, tn = statistics.median(times["1"]), statistics.median(times[str(W)])
    print(f"decode step, medians of {args.rounds} alternating rounds: 1 column {t1 * 1e3:.2f} ms, {W} columns "
          f"{tn * 1e3:.2f} ms ({tn / t1:.2f}x); engine-only bound for {W} streams against one: "
          f"{W * t1 / tn:.2f}x", flush=True)

    k1, kn = kernel_times(st, 1, pos), kernel_times(st, W, pos)
    s1, sn = sum(v[0] for v in k1.values()), sum(v[0] for v in kn.values())
    print(f"\nkernels alone ({REPS} in a row, warm cache), ms per step:\n{'kind':<24s} {'1 col':>8s} "
          f"{W:>5d} col {'ratio':>6s} {'share':>6s}")
    for k in sorted(set(k1) | set(kn), key=lambda k: -kn.get(k, (0, 0))[0] - k1.get(k, (0, 0))[0]):
        a, b = k1.get(k, (0.0, 0))[0], kn.get(k, (0.0, 0))[0]
        print(f"{k:<24s} {a * 1e3:8.2f} {b * 1e3:9.2f} {b / a if a else float('nan'):6.2f} {b / sn:6.1%}")
    print(f"{'sum':<24s} {s1 * 1e3:8.2f} {sn * 1e3:9.2f} {sn / s1:6.2f}   (the step: {t1 * 1e3:.2f} / "
          f"{tn * 1e3:.2f} ms; the rest is memory traffic, the runner's waits, Python)")
    r1, rn = runner_time(st, 1, pos), runner_time(st, W, pos)
    print(f"{'runner alone':<24s} {r1 * 1e3:8.2f} {rn * 1e3:9.2f} {rn / r1:6.2f}   (the step's kernels in order, no "
          f"Python: traffic and waits {(r1 - s1) * 1e3:.2f} / {(rn - sn) * 1e3:.2f} ms, Python and hand-off "
          f"{(t1 - r1) * 1e3:.2f} / {(tn - rn) * 1e3:.2f} ms)")

    if args.knockout:
        kinds = sorted(set(k1) | set(kn), key=lambda k: -kn.get(k, (0, 0))[0])
        o1, on = knockout(st, 1, pos, kinds, args.knockout), knockout(st, W, pos, kinds, args.knockout)
        print(f"\nin the step (runner alone less the kind's kernels, medians of {args.knockout}), ms per step:\n"
              f"{'kind':<24s} {'1 col':>8s} {W:>5d} col")
        for k in sorted(kinds, key=lambda k: -on[k]):
            print(f"{k:<24s} {o1[k] * 1e3:8.2f} {on[k] * 1e3:9.2f}")
        print(f"{'sum':<24s} {sum(o1.values()) * 1e3:8.2f} {sum(on.values()) * 1e3:9.2f}   (runner alone {r1 * 1e3:.2f}"
              f" / {rn * 1e3:.2f} ms)")

    if args.mixed:   # slot W: a prompt chunk of 16 at its next positions, beside the W decode columns
        chunk = lambda p: [Column(p + i, W, False, 7 + i) for i in range(16)]  # noqa: E731
        pos_c = args.prompt
        timed("warm", [*chunk(pos_c), *[Column(pos, s, True, 5) for s in range(W)]])   # compiles the mixed shape
        pos += 1
        pos_c += 16
        for r in range(max(4, args.rounds // 2)):
            if pos_c + 32 > CONTEXT or pos + 2 > CONTEXT:
                break
            order = ("mixed", "apart") if r % 2 else ("apart", "mixed")
            for tag in order:
                if tag == "mixed":
                    timed("mixed", [*chunk(pos_c), *[Column(pos, s, True, 5) for s in range(W)]])
                else:
                    t = time.perf_counter()
                    st.step(chunk(pos_c), None, greedy)
                    st.step([Column(pos, s, True, 5) for s in range(W)], None, greedy)
                    times["apart"].append(time.perf_counter() - t)
                pos += 1
                pos_c += 16
        m, a = statistics.median(times["mixed"]), statistics.median(times["apart"])
        print(f"\nprefill chunk of 16 + {W} decode columns: one step {m * 1e3:.2f} ms, the chunk's step then the "
              f"decode step {a * 1e3:.2f} ms (one step = {m / a:.2f}x apart; {len(times['mixed'])} rounds)")
    print(f"\nload {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
