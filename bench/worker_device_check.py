"""Check the worker on an accelerator: probe, device fallbacks, and a tiny model through two chained worker processes
against in-process Stages on the same device.

    DEV=CUDA python bench/worker_device_check.py

Runs the workers three ways: the device as asked, the device with nvcc taken off PATH (CUDA -> CUDA:PTX), and with
no device named (the child's own default). Prints each worker's Ready event and whether tokens and the activations
handed between the two workers equal the in-process run bitwise.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import trio  # noqa: E402

from engine.stage import Column, Sampling, Stage  # noqa: E402
from engine.worker import open_worker  # noqa: E402
from tests.tiny_gguf import write_tiny_gguf  # noqa: E402

PROMPT, N = [3, 17, 42, 99, 7], 8


async def decode(run) -> tuple[list[int], list[np.ndarray]]:
    toks, acts = list(PROMPT), []
    cols = [Column(p, 0, p == len(PROMPT) - 1, t) for p, t in enumerate(PROMPT)]
    for _ in range(N):
        h = await run(0, cols, None)
        acts.append(h)
        toks.append(int((await run(1, cols, h))[0]))
        cols = [Column(len(toks) - 1, 0, True, toks[-1])]
    return toks, acts


async def main() -> None:
    device = os.environ.get("DEV")
    path = write_tiny_gguf(Path("/tmp") / "worker_device_check.gguf", n_layers=4, dim=64, vocab_size=256)
    print("DEV:", device, "nvcc:", shutil.which("nvcc"), "CC:", os.environ.get("CC"), "clang:", shutil.which("clang"))
    stages = [Stage.load(path, 0, 2, n_slots=1, max_context=64), Stage.load(path, 2, 4, n_slots=1, max_context=64)]

    async def local(i, cols, h):
        return stages[i].step(cols, h, Sampling())
    ref_t, ref_a = await decode(local)
    nvcc = shutil.which("nvcc")
    no_nvcc = dict(os.environ, PATH=os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                                                   if not nvcc or d != os.path.dirname(nvcc)))
    for label, dev, env in (("as asked", device, None), ("no nvcc", device, no_nvcc), ("no device named", None, None)):
        t0 = time.perf_counter()
        try:
            async with open_worker(device=dev, env=env) as a, open_worker(device=dev, env=env) as b:
                print(f"{label}: {a.ready} (two workers open in {time.perf_counter() - t0:.1f} s)")
                await a.load(path, 0, 2, n_slots=1, max_context=64)
                await b.load(path, 2, 4, n_slots=1, max_context=64)
                workers = [a, b]

                async def remote(i, cols, h):
                    return await workers[i].step(cols, h, Sampling())
                toks, acts = await decode(remote)
                bitwise = all(x.tobytes() == y.tobytes() for x, y in zip(acts, ref_a))
                diff = max(float(np.abs(x - y).max()) for x, y in zip(acts, ref_a))
                print(f"{label}: tokens equal {toks == ref_t}, activations bitwise {bitwise} (max diff {diff:.3g})")
        except Exception as exc:  # report every variant, whatever fails
            print(f"{label}: FAILED {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    trio.run(main)
