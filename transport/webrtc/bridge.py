"""One asyncio loop in one thread, and the only door from trio into it.

aiortc is asyncio-only. Rather than run trio on top of asyncio (trio-asyncio measured 2.5x slower here), every
aiortc object lives on a private asyncio loop in a dedicated thread, and trio reaches it only through
`RtcBridge.call`. Bytes do not cross through the bridge at all: a data channel is handed to trio as one end of a
socketpair (see `channel.py`), so the hot path is plain trio socket I/O.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import outcome
import trio

from .errors import BridgeClosedError

T = TypeVar("T")

# Closing peer connections at shutdown must not hang the trio side forever if a transport misbehaves.
_SHUTDOWN_GRACE_S = 5.0


class _Call:
    """One coroutine submitted from trio; lives on both sides, touched by each only from its own thread."""

    __slots__ = ("_loop", "_calls", "_fn", "_args", "_task", "_token", "_atask", "_cancel_requested",
                 "_raise_cancel")

    def __init__(self, loop: asyncio.AbstractEventLoop, calls: set[_Call], fn: Callable[..., Awaitable[Any]],
                 args: tuple[Any, ...]) -> None:
        self._loop = loop
        self._calls = calls  # the bridge's in-flight set; trio thread only
        self._fn = fn
        self._args = args
        self._task = trio.lowlevel.current_task()
        self._token = trio.lowlevel.current_trio_token()
        self._atask: asyncio.Task[Any] | None = None
        self._cancel_requested = False  # loop thread only
        self._raise_cancel: Callable[[], Any] | None = None  # trio thread only

    # --- loop thread -------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._cancel_requested:
            self._token.run_sync_soon(self._wake, None)
            return
        # The coroutine is created inside the task, on the loop: a call cancelled before it started leaves no
        # never-awaited coroutine behind, and a function that raises before its first await still reports here.
        self._atask = asyncio.get_running_loop().create_task(self._run())
        self._atask.add_done_callback(lambda t: self._token.run_sync_soon(self._wake, t))

    async def _run(self) -> Any:
        return await self._fn(*self._args)

    def cancel(self) -> None:
        self._cancel_requested = True
        if self._atask is not None:
            self._atask.cancel()

    # --- trio thread -------------------------------------------------------------------------------------------
    def abort(self, raise_cancel: Callable[[], Any]) -> trio.lowlevel.Abort:
        # Wait for the asyncio task to really finish, so nothing it owns outlives the trio cancellation.
        self._raise_cancel = raise_cancel
        try:
            self._loop.call_soon_threadsafe(self.cancel)
        except RuntimeError:  # loop already closed: the task is gone with it
            self._calls.discard(self)
            return trio.lowlevel.Abort.SUCCEEDED
        return trio.lowlevel.Abort.FAILED

    def orphan(self) -> None:
        """The loop ended without ever finishing this call (trio thread)."""
        self._wake(None)

    def _wake(self, atask: asyncio.Task[Any] | None) -> None:
        if self not in self._calls:
            return
        self._calls.discard(self)
        if self._raise_cancel is not None:
            result: outcome.Outcome[Any] = outcome.capture(self._raise_cancel)
        elif atask is None or atask.cancelled():
            result = outcome.Error(BridgeClosedError("the WebRTC bridge closed while a call was in flight"))
        elif atask.exception() is not None:
            result = outcome.Error(atask.exception())  # type: ignore[arg-type]
        else:
            result = outcome.Value(atask.result())
        trio.lowlevel.reschedule(self._task, result)


class RtcBridge:
    """The asyncio loop thread that owns every aiortc object of one process part (usually one per peer)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._closing = False
        self._calls: set[_Call] = set()
        # Asyncio-side objects with an `async aclose_on_loop()`; closed by the bridge at exit (loop thread only).
        self._owned: set[Any] = set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `await fn(*args)` on the loop thread and return its result here.

        Exceptions propagate unchanged (map them at your boundary). Trio cancellation cancels the asyncio task and
        waits for it to unwind before raising `trio.Cancelled`.
        """
        if self._closing:
            await trio.lowlevel.checkpoint()
            raise BridgeClosedError("the WebRTC bridge is closed")
        call = _Call(self._loop, self._calls, fn, args)
        try:
            self._loop.call_soon_threadsafe(call.start)
        except RuntimeError as exc:
            await trio.lowlevel.checkpoint()
            raise BridgeClosedError("the WebRTC bridge's loop is not running") from exc
        self._calls.add(call)
        return await trio.lowlevel.wait_task_rescheduled(call.abort)  # type: ignore[no-any-return]

    # --- loop thread helpers for the objects that live here -----------------------------------------------------
    def own(self, obj: Any) -> None:
        """Register a loop-side object whose `aclose_on_loop()` must run before the loop stops."""
        self._owned.add(obj)

    def disown(self, obj: Any) -> None:
        self._owned.discard(obj)

    async def _close_owned(self) -> None:
        owned, self._owned = list(self._owned), set()
        if owned:
            await asyncio.wait(
                [asyncio.ensure_future(o.aclose_on_loop()) for o in owned], timeout=_SHUTDOWN_GRACE_S
            )


def _loop_thread(loop: asyncio.AbstractEventLoop, done: Callable[[], None]) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        # Anything still pending (pumps, aioice timers) is cancelled and allowed to unwind, then the default
        # executor (used by getaddrinfo for STUN/TURN host names) is joined, so no thread survives the bridge.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        asyncio.set_event_loop(None)
        loop.close()
        done()


@asynccontextmanager
async def open_rtc_bridge() -> AsyncIterator[RtcBridge]:
    """Start the asyncio loop thread; on exit close every peer connection on it and join the thread."""
    loop = asyncio.new_event_loop()
    token = trio.lowlevel.current_trio_token()
    finished = trio.Event()

    def done() -> None:
        try:
            token.run_sync_soon(finished.set)
        except trio.RunFinishedError:  # pragma: no cover - trio is gone; nobody is waiting
            pass

    thread = threading.Thread(target=_loop_thread, args=(loop, done), name="mesh-rtc-bridge", daemon=True)
    thread.start()
    bridge = RtcBridge(loop)
    try:
        yield bridge
    finally:
        with trio.CancelScope(shield=True):
            try:
                await bridge.call(bridge._close_owned)
            finally:
                bridge._closing = True
                loop.call_soon_threadsafe(loop.stop)
                await finished.wait()
                # trio runs run_sync_soon callbacks in order, so every wake the loop queued has run by now; a call
                # still here was submitted but never started.
                for call in list(bridge._calls):
                    call.orphan()
                thread.join()  # the thread has already signalled its last act; this returns at once
