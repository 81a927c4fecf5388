"""What the HTTP layer costs a streamed answer: the same greedy request read straight from the scheduler (in the
coordinator's loop) and through the OpenAI API (hypercorn, SSE, the official openai client in another thread),
alternating, on one mesh (one in-process peer holding the model; its stage in a worker process).

    .venv/bin/python bench/api_overhead.py [--model PATH] [--tokens 64] [--rounds 3]

Prints per round each way's time to the first token and decode rate after it, and the ratio of the rates
(1.00 = the HTTP layer is free). The API path counts a token when the client has parsed its chunk.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.chat import render_prompt  # noqa: E402
from engine.sources import default_model_path  # noqa: E402
from mesh.scheduler import Request  # noqa: E402
from common.values import Sampling  # noqa: E402
from tests.serve_fixtures import LiveServer  # noqa: E402

QUESTION = "Tell me a long story about a lighthouse keeper."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None, help="default: the bundled SmolLM2; 'tiny' makes the tests' "
                    "tiny chat model, whose ~ms steps let the HTTP layer's own cost show")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = args.model or Path(default_model_path())
    if str(model) == "tiny":
        import tempfile
        from tests.mesh_fixtures import write_tiny_chat_model
        model = write_tiny_chat_model(Path(tempfile.mkdtemp()) / "tiny-chat.gguf", n_layers=2)
    import openai
    with LiveServer(model, max_seqs=1, max_queue=4, max_context=2048) as srv:
        svc = srv.service
        ids = tuple(svc.coord.tokenizer.encode(render_prompt(svc.coord.tokenizer, QUESTION)))

        async def direct() -> list[float]:
            times = [time.perf_counter()]
            req = Request(ids, args.tokens, Sampling(), frozenset())     # no stop ids: always args.tokens
            async with svc.scheduler.open(req) as gen:
                async for _ in gen:
                    times.append(time.perf_counter())
            return times

        def api(client) -> list[float]:
            times = [time.perf_counter()]
            for ch in client.completions.create(model=svc.model_id, prompt=list(ids), max_tokens=args.tokens,
                                                temperature=0, stream=True):
                if ch.choices and ch.choices[0].text:
                    times.append(time.perf_counter())
            return times

        def figures(times: list[float]) -> tuple[float, float]:
            """(time to the first token, decode tokens per second after it)"""
            return (times[1] - times[0]) * 1e3, (len(times) - 2) / (times[-1] - times[1])
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=600) as client:
            srv.run(direct)                       # compile and warm both paths once
            api(client)
            print(f"{'round':>5} {'direct TTFT ms':>14} {'API TTFT ms':>11} {'direct tok/s':>12} {'API tok/s':>9} "
                  f"{'API/direct tok/s':>16}")
            for r in range(args.rounds):
                (dt, dr), (at, ar) = figures(srv.run(direct)), figures(api(client))
                print(f"{r + 1:>5} {dt:>14.1f} {at:>11.1f} {dr:>12.1f} {ar:>9.1f} {ar / dr:>16.3f}", flush=True)


if __name__ == "__main__":
    main()
