"""Which kernel first gives a sequence different bits alone and beside another one, with 8-bit x on the tensor cores.

Runs the serving-stage test's case (tests/test_matvec_s8.py: a tiny model, sequence a alone, then a beside b, one
unsharded tc stage) with every s8 matmul's inputs and outputs recorded: x, the quantized q and d, and the result,
each cut to sequence a's columns. Prints, per call in step order, which of them differ and by how much, so the
first kernel whose inputs agree and outputs do not is named. For GPUs (the PYTHON device gives equal bits):

    DEV=CUDA python3 bench/s8_bisect.py --qtype Q8_0
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qtype", default="Q8_0")
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    os.environ["NO_MEMORY_PLANNER"] = "1"  # every recorded buffer its own, not shared with a later kernel's
    os.environ["MESH_GPU_TC_SLOTS"] = "2"
    os.environ["MESH_GPU_TC_X8"] = "1"
    os.environ.pop("MESH_GPU_MV", None)
    import engine.matvec_gpu_s8 as s8
    import engine.quant as quant
    from engine.stage import Stage
    from tests.test_matvec_tc import _greedy
    from tests.tiny_gguf import write_tiny_gguf

    calls: list[tuple[str, dict]] = []  # (what, {name: tensor}), in call order
    quantize, matmul = s8.quantize, s8.s8_matmul_t

    def rec_quantize(x, norm=None, glu=False, sums=True):
        q, d, s = quantize(x, norm, glu, sums)
        # a stage's input buffer is rewritten every step: its x is not kept (compare q and d there)
        calls.append(("quantize" + ("+norm" if norm else "") + ("+glu" if glu else ""),
                      {"x": None if x.uop.is_realized else x, "q": q, "d": d.T}))
        return q, d, s

    def rec_matmul(words, scales, ggml_type, x, **kw):
        out = matmul(words, scales, ggml_type, x, **kw)
        calls.append((f"matmul {tuple(words.shape)}" + ("+res" if kw.get("residual") is not None else ""), {"out": out}))
        return out
    s8.quantize, quant.s8_matmul_t = rec_quantize, rec_matmul

    p = write_tiny_gguf(Path(tempfile.mkdtemp()) / "m.gguf", n_layers=2, dim=64, n_heads=2, n_kv_heads=1, ffn_dim=32,
                        vocab_size=32, qtype=args.qtype)
    a, b = [3, 17, 22], [9, 5]
    runs = {}
    for name, seqs in (("alone", {0: a}), ("beside", {0: a, 1: b})):
        st = Stage.load(p, 0, 2, n_slots=2, max_context=32, jit=False)
        calls.clear()
        logits = _greedy([st], seqs, args.steps)[0]
        runs[name] = ([(w, {k: None if t is None else t.numpy() for k, t in ts.items()}) for w, ts in calls], logits)
    (ca, la), (cb, lb) = runs["alone"], runs["beside"]
    per = len(cb) // (1 + args.steps)  # the beside run: the two prompts in one step, then the decode steps
    if len(cb) % (1 + args.steps) or len(ca) % per or [w for w, _ in ca[:per]] != [w for w, _ in cb[:per]]:
        sys.exit(f"the runs' calls do not split into steps alike:\n{[w for w, _ in ca]}\n{[w for w, _ in cb]}")
    alone_steps = len(ca) // per  # a prompt may run a column a step (a GPU stage's prefill), or in one step
    rows = []  # (token, alone's (step, row), beside's (step, row)) of sequence a's columns
    for t in range(len(a) + args.steps):
        if t < len(a):
            ra = (t, 0) if alone_steps > 1 + args.steps else (0, t)
            rows.append((t, ra, (0, t)))
        else:
            rows.append((t, (alone_steps - (len(a) + args.steps - t), 0), (1 + t - len(a), 0)))
    first = None
    for t, (sa, ia), (sb, ib) in rows:
        for j in range(per):
            what, xa = ca[sa * per + j]
            xb = cb[sb * per + j][1]
            ja, jb = ia, ib
            na, nb = (next(u.shape[0] for u in x.values() if u is not None) for x in (xa, xb))
            if nb < na or nb == 2 and t < len(a):  # the head: last columns only
                if t != len(a) - 1:
                    continue
                ja, jb = (0 if na < len(a) else ia), 0
            diffs = []
            for k in xa:
                u, v = xa[k], xb[k]
                if u is None or v is None:
                    continue
                u, v = u[ja], v[jb]
                bad = u != v
                if bad.any():
                    fu, fv = u.astype(np.float64), v.astype(np.float64)
                    diffs.append(f"{k}: {int(bad.sum())}/{bad.size} differ, max |diff| {np.abs(fu - fv)[bad].max():.3g}")
            print(f"token {t} call {j:2d} {what:28s} {'equal' if not diffs else '; '.join(diffs)}")
            if diffs and first is None:
                first = (t, j, what)
    print("logits:", "equal" if all(np.array_equal(x, y) for x, y in zip(la, lb)) else "DIFFER",
          "| first differing call (token, call, what):", first)


if __name__ == "__main__":
    main()
