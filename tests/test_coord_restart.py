"""A restarted coordinator: `mesh-coord` is killed while its two peers serve, a new one starts on the same address
and token, the peers are back within 5 s (their re-join backoff is capped at 5 s) and new HTTP requests are served,
bitwise as before. Processes as a user runs them; each line of their logs is timed as it arrives.
"""
from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.mesh_fixtures import free_port, mesh_cmd, processes, write_tiny_chat_model
from tests.test_serve_api import MODEL_ID

pytestmark = pytest.mark.slow       # three processes, a coordinator started twice, ~8 s of backoff to reach its cap
TOKEN = "restart-fleet-token-0123456789"
REJOIN_CAP = 5.0                    # mesh.peer PeerConfig.rejoin_max_delay
HANDSHAKE_MARGIN = 1.5              # a dial and the sealed handshake on a loaded 2-core box


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / f"{MODEL_ID}.gguf", n_layers=2)


class Lines:
    """A process's stderr, read in a thread: every line with the time.monotonic() it arrived at."""

    def __init__(self, pipe):
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe) -> None:
        for raw in pipe:
            with self._cond:
                self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))
                self._cond.notify_all()
        with self._cond:
            self.lines.append((time.monotonic(), None))       # end of the stream
            self._cond.notify_all()

    def wait_for(self, pattern: str, *, after: float = 0.0, timeout: float = 120.0) -> float:
        """The arrival time of the first line matching `pattern` that arrived after `after`."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, line in self.lines:
                    if t >= after and line is not None and rx.search(line):
                        return t
                    if line is None:
                        raise AssertionError(f"{pattern!r}: the process ended\n" + self.text())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{pattern!r} not seen within {timeout:.0f}s\n" + self.text())
                self._cond.wait(left)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines if line is not None)


def answer(http: int) -> str:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        r = c.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=16, temperature=0)
    return r.choices[0].text


def test_peers_rejoin_a_restarted_coordinator_within_five_seconds(model):
    reg, http = free_port(), free_port()
    coord_cmd = mesh_cmd("coord", "--listen", f"127.0.0.1:{reg}", "--http", f"127.0.0.1:{http}", "--model", str(model),
                         "--token", TOKEN, "--min-peers", "2", "--settle", "0.2", "--no-discovery", "--max-seqs", "2")
    with processes() as start:
        coord = start(coord_cmd)
        clog = Lines(coord.stderr)
        peers = [start(mesh_cmd("peer", "--join", f"127.0.0.1:{reg}", "--listen", "127.0.0.1:0", "--model",
                                str(model), "--warmup", "0", "--token", TOKEN, "--name", f"p{i}")) for i in range(2)]
        plogs = [Lines(p.stderr) for p in peers]
        clog.wait_for(r"serving tiny-chat on 2 peer")
        before = answer(http)

        coord.send_signal(signal.SIGKILL)
        coord.wait()
        killed = time.monotonic()
        # the coordinator stays away until both peers back off to the cap (0.25, 0.5, 1, 2, 4, then 5 s less up to
        # 10% jitter): the restart then meets each peer at the start of its longest wait
        for log in plogs:
            log.wait_for(r"unreachable for .*next try in (4\.[5-9]|5)", after=killed, timeout=60)

        coord = start(coord_cmd)
        clog = Lines(coord.stderr)
        up = clog.wait_for(r"registry listening on")
        joined = [clog.wait_for(rf"p{i} \(127\.0\.0\.1\) joined", timeout=30) for i in range(2)]
        rejoin = max(joined) - up
        clog.wait_for(r"serving tiny-chat on 2 peer")
        t0 = time.monotonic()
        after = answer(http)
        served = time.monotonic() - up
        print(f"re-join after the restart: {rejoin:.2f} s (p0 {joined[0] - up:.2f}, p1 {joined[1] - up:.2f}); "
              f"first answer served {served:.2f} s after the registry listened (the answer took {time.monotonic() - t0:.2f} s)")
        assert rejoin <= REJOIN_CAP + HANDSHAKE_MARGIN, clog.text()
        assert after == before and after
