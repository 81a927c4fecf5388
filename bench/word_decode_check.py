"""The word decode against the byte-wise one on a real GPU, case by case (a CUDA run of
tests/test_matvec_gpu.py::test_word_decode_gives_the_byte_decodes_bits failed for Q8_0, 32 rows, 1 column, plain).

    DEV=CUDA python3 bench/word_decode_check.py

For each case: outputs of MESH_GPU_CVT=byte and of the word decode, how many differ and by how much, each one's
largest error against float64; then one-hot inputs (each column of x picks one weight column, so every product is
a decoded value times 1 and every sum adds zeros): there the outputs are scale x quant exactly whatever the
compiler contracts, so a difference there is a wrong decoded value, and none there but some above is the
compiler's choice of which product an FMA absorbs.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_matvec_gpu import DEV, Q, _any_quants, _run  # noqa: E402
from gguf.quants import dequantize  # noqa: E402


def both(raw, qtype, rows, cols, x, mode):
    os.environ["MESH_GPU_CVT"] = "byte"
    want = _run(raw, qtype, rows, cols, x, mode)
    os.environ.pop("MESH_GPU_CVT")
    return want, _run(raw, qtype, rows, cols, x, mode)


def main() -> None:
    cols = 256
    for qtype, rows, n, mode in [("Q4_0", 16, 2, "norm"), ("Q8_0", 32, 1, "plain"), ("Q4_0", 4, 1, "plain"),
                                 ("Q8_0", 16, 3, "norm"), ("Q8_0", 32, 4, "plain"), ("Q8_0", 64, 1, "plain")]:
        raw = _any_quants(qtype, rows, cols)
        x = np.random.default_rng(3).standard_normal((n, cols)).astype(np.float32)
        want, got = both(raw, qtype, rows, cols, x, mode)
        w = dequantize(raw, Q[qtype]).reshape(rows, cols).astype(np.float64)
        ref = x.astype(np.float64) @ w.T
        diff = got != want
        line = (f"{qtype} rows {rows} n {n} {mode}: {int(diff.sum())}/{diff.size} differ, max |word-byte| "
                f"{float(np.abs(got - want).max()):.3g}")
        if mode == "plain":
            scale = np.abs(ref).max()
            line += (f"; max err vs f64 / max|ref|: byte {float(np.abs(want - ref).max() / scale):.2e}, word "
                     f"{float(np.abs(got - ref).max() / scale):.2e}")
            onehot = np.zeros((8, cols), np.float32)
            picks = np.random.default_rng(1).choice(cols, 8, replace=False)
            onehot[np.arange(8), picks] = 1
            ob, ow = both(raw, qtype, rows, cols, onehot, mode)
            exact = w[:, picks].T
            line += (f"; one-hot: word != byte {int((ob != ow).sum())}, byte != f64 {int((ob != exact).sum())}, "
                     f"word != f64 {int((ow != exact).sum())} of {ob.size}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
