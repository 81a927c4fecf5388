"""engine/cuda_graph.py: the lean CUDA graph gives the same bits as tinygrad's own, step after step.

One scenario runs in two processes on a CUDA device, with tinygrad's CUDAGraph (MESH_LEAN_GRAPH=0) and with the lean
one: a two-stage split of a tiny model (head size 32, so the GPU's split attention and its rounded ctx are used)
takes prompts into 16 slots, then decode steps of every width, positions crossing chunk boundaries, slots leaving
and coming back (the slot variables change under the same graph), each step's outputs hashed. The hashes must be
equal, and the lean process must have run lean graphs. Skipped without a CUDA device (the H200 runs it:
bench/h200_synth.sh s12)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cuda() -> bool:
    if os.environ.get("DEV", "").upper().split(":")[0] != "CUDA":
        return False
    try:
        from tinygrad import Device
        Device["CUDA"]
        return True
    except Exception:
        return False


SCENARIO = r"""
import hashlib, json, sys
import numpy as np
from tinygrad import Device
from engine.stage import Column, Stage
path, = sys.argv[1:]
a = Stage.load(path, 0, 2, n_slots=16, max_context=160)
b = Stage.load(path, 2, 4, n_slots=16, max_context=160)
h = hashlib.sha256()
lens = {}
def step(cols):
    x = a.step([Column(c.pos, c.slot, False, c.token) for c in cols])
    h.update(x.tobytes())
    out = b.step([Column(c.pos, c.slot, True) for c in cols], x)
    h.update(np.asarray(out).tobytes())
    return out
for s in range(16):  # prompts of 1..16 tokens
    n = s + 1
    out = step([Column(p, s, False, (7 * s + p) % 250) for p in range(n)])
    lens[s] = n
tok = {s: 1 for s in range(16)}
for k in range(60):
    live = [s for s in range(16) if (k < 20 or s % 3) and not (30 <= k < 40 and s < 8)]
    live = live[: 1 + k % 16] if k % 5 == 0 else live
    out = step([Column(lens[s], s, False, tok[s]) for s in live])
    for s, t in zip(live, np.asarray(out).reshape(-1)):
        lens[s] += 1
        tok[s] = int(t) % 250
from tinygrad.engine.jit import graph_class
print(json.dumps({"hash": h.hexdigest(), "graph": graph_class(Device["CUDA"]).__name__, "lens": lens}))
"""


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device (DEV=CUDA)")
def test_lean_graph_bits_equal_tinygrads(tmp_path):
    from tests.tiny_gguf import write_tiny_gguf
    model = write_tiny_gguf(tmp_path / "m.gguf", n_layers=4, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256,
                            context_length=160)
    runs = {}
    for lean in ("0", "1"):
        env = dict(os.environ, MESH_LEAN_GRAPH=lean, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
        p = subprocess.run([sys.executable, "-c", SCENARIO, str(model)], env=env, capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[lean] = json.loads(p.stdout.strip().splitlines()[-1])
    assert runs["0"]["graph"] == "CUDAGraph"
    assert runs["1"]["graph"] == "LeanCUDAGraph"
    assert max(runs["1"]["lens"].values()) > 64  # positions crossed chunks of 32 while decoding
    assert runs["1"]["hash"] == runs["0"]["hash"]
