"""Placement by memory vs by measured speed, side by side in one run, on the same two peers (SmolLM2 by default).

One peer is slowed on purpose: its worker sleeps --slow-ms per layer in every step (MESH_TEST_SLOW_MS_PER_LAYER), as
a slower device would take. Each configuration starts both peers afresh (so no loaded layout is kept from the run
before) with the same cache directories, then runs `mesh-coord --prompt --json`:
1. --placement memory: both peers report the same free memory, so each holds half the layers; their loads (with
   warmup) measure each peer, and the figures stay in its cache;
2. --placement speed: the planner reads those figures, times each peer's link, and plans.
Prints each plan's layers, the planner's predicted decode tok/s and the measured one, and the ratio speed / memory.

    .venv/bin/python bench/placement_bench.py [--slow-ms 10] [--tokens 48] [--model PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write two sentences about the sea."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: Path, placement: str, caches: Path, slow_ms: float, tokens: int) -> tuple[dict, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("MESH_TOKEN", None)
    peers = []
    try:
        for name, slow in (("fast", ""), ("slow", str(slow_ms))):
            peers.append(subprocess.Popen(
                [sys.executable, "-m", "mesh", "peer", "--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                 "--insecure-open", "--model", str(model), "--cache-dir", str(caches / name)],
                cwd=ROOT, env=dict(env, MESH_TEST_SLOW_MS_PER_LAYER=slow), stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True))
        coord = subprocess.run(
            [sys.executable, "-m", "mesh", "coord", "--listen", f"127.0.0.1:{port}", "--model", str(model),
             "--insecure-open", "--min-peers", "2", "--settle", "0.5", "--wait", "300", "--prompt", PROMPT,
             "--max-tokens", str(tokens), "--json", "--placement", placement],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:
        for p in peers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if coord.returncode != 0:
        sys.exit(f"placement_bench: the {placement} run failed:\n{coord.stderr}")
    return json.loads(coord.stdout.strip().splitlines()[-1]), coord.stderr


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, help="GGUF (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--slow-ms", type=float, default=10.0, help="sleep per layer per step on the slow peer")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from engine.sources import default_model_path
        args.model = default_model_path()
    results = {}
    with tempfile.TemporaryDirectory(prefix="placement-bench-") as tmp:
        for placement in ("memory", "speed"):
            answer, err = run(args.model, placement, Path(tmp), args.slow_ms, args.tokens)
            stages = re.findall(r"^stage \d+: (.+?) \([^)]*\), layers (\d+)\.\.(\d+)", err, re.M)
            predicted = re.search(r"placement by \w+: predicted ([\d.]+) tok/s decode", err)
            left = re.findall(r"left out (.*)$", err, re.M)
            results[placement] = answer
            print(f"{placement:>6}: layers {', '.join(f'{n} {a}..{b}' for n, a, b in stages)}; predicted "
                  f"{predicted.group(1) if predicted else '?'} tok/s, measured {answer['decode_tok_s']} tok/s "
                  f"(first token {answer['first_token_s']} s)")
            for line in left:
                print(f"        left out {line}")
    same = results["memory"]["tokens"] == results["speed"]["tokens"]
    print(f"speed / memory decode: {results['speed']['decode_tok_s'] / results['memory']['decode_tok_s']:.2f}x; "
          f"tokens {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
