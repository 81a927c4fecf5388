"""A real serving coordinator on loopback for HTTP tests: registry, in-process peers (each stage in its worker
process), the Service and hypercorn, all on one trio loop in a background thread, so a test can use blocking
clients (the official `openai` package, sync and async) against it as a user would.
"""
from __future__ import annotations

import threading
from pathlib import Path

import trio

from mesh.coordinator import CoordConfig, Coordinator
from mesh.peer import Peer, PeerConfig
from mesh.serve.app import build_app
from mesh.serve.service import Service, serve_http
from tests.mesh_fixtures import free_port

TOKEN = b"serve-test-fleet-token-0123456789"


class LiveServer:
    """`with LiveServer(model, peers=[(0, 2)]) as srv:` serves on srv.base_url once the mesh has formed (or at once
    with `wait_formed=False`). `peers` pins each in-process peer to layers (start, end); [] starts none."""

    def __init__(self, model: Path, *, peers=((0, None),), api_key: str | None = None, max_seqs: int = 2,
                 max_queue: int = 2, max_context: int = 256, wait_formed: bool = True, cache_dir: Path | None = None,
                 min_peers: int | None = None):
        self.model, self.peers, self.api_key = model, list(peers), api_key
        self.min_peers = max(len(self.peers), 1) if min_peers is None else min_peers   # peers of other processes too
        self.max_seqs, self.max_queue, self.max_context = max_seqs, max_queue, max_context
        self.wait_formed, self.cache_dir = wait_formed, cache_dir
        self.port: int | None = None
        self.service: Service | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token = None
        self._cancel = None
        self.peer_scopes: list[trio.CancelScope] = []
        self._nursery = None
        self._thread = threading.Thread(target=self._thread_main, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def call(self, fn, *args):
        """Run a synchronous function on the server's trio loop (to read its state without races)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def run(self, async_fn, *args):
        return trio.from_thread.run(async_fn, *args, trio_token=self._token)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        if not self._ready.wait(300):
            raise TimeoutError("the test server did not come up within 300 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            try:
                trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(60)

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:      # shown by __enter__ or the test that waits on it
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self.reg = reg = free_port()
        cfg = CoordConfig(model=self.model, listen=f"127.0.0.1:{reg}", token=TOKEN, min_peers=self.min_peers,
                          settle=0.2, max_context=self.max_context, n_slots=self.max_seqs)
        coord = Coordinator(cfg)
        self.service = Service(coord, max_seqs=self.max_seqs, max_queue=self.max_queue, api_key=self.api_key)
        async with trio.open_nursery() as nursery:
            self._cancel = nursery.cancel_scope
            await coord.serve_registry(nursery)
            self.port = await nursery.start(serve_http, build_app(self.service), "127.0.0.1", 0)
            nursery.start_soon(self.service.run)
            self._nursery = nursery
            for layers in self.peers:
                self.add_peer(layers)
            if self.wait_formed:
                with trio.fail_after(240):
                    await self.service.wait_state(lambda s: s.state == "serving")
            self._ready.set()

    def add_peer(self, layers=None) -> int:
        """Start one more in-process peer (call on the server's loop: `srv.call(srv.add_peer)`); returns its index."""
        scope = trio.CancelScope()
        self.peer_scopes.append(scope)

        async def run() -> None:
            with scope:
                await self.peer(layers).run()
        self._nursery.start_soon(run)
        return len(self.peer_scopes) - 1

    def stop_peer(self, k: int) -> None:
        """Take peer k away (its links close, as when a machine leaves)."""
        self.peer_scopes[k].cancel()

    def peer(self, layers) -> Peer:
        pinned = layers if layers and layers[1] is not None else None
        return Peer(PeerConfig(join=f"127.0.0.1:{self.reg}",
                               token=TOKEN, listen="127.0.0.1:0", model=self.model, layers=pinned, warmup=0,
                               max_context=self.max_context, cache_dir=self.cache_dir,
                               rejoin_max_delay=0.5))
