"""A framed, authenticated, flow-controlled, heart-beating connection over any `trio.abc.Stream`.

`open_link(stream, token=..., role=...)` runs the handshake (the caller bounds it with `trio.fail_after`), then
keeps three tasks in its own nursery for as long as the link lives:

- the reader decodes frames, answers Ping, applies WindowUpdate and queues every other event. It never writes to the
  stream itself (it only flags a Pong or a WindowUpdate as owed), so a peer that is slow to read can never stop us
  reading, and two links that both fill their pipes cannot deadlock on each other's heartbeats;
- the control task writes what is owed: Pongs, WindowUpdates, and a Ping every `ping_interval`;
- the watchdog declares the peer dead when nothing at all arrived for `dead_after` and closes the stream, which also
  wakes any send stuck on a peer that stopped reading.

The handshake (mesh/proto/auth.py) is bounded before it authenticates: frames of at most HANDSHAKE_MAX_FRAME bytes,
small reads, and, on a listener, a `PreAuthGate` capping how many connections may be authenticating at once. Every
frame after Hello/Welcome is sealed (mesh/proto/seal.py). Text the peer sends (an Error's reason) reaches our
exceptions escaped and truncated (`mesh.logsafe.clean`).

Failures never cancel the caller: they are recorded, and the next `send()`/`receive()` raises them. Events already
queued are still delivered first. Frames are written whole: a cancelled `send()` gives up only before its first
byte went out, because a half-written frame would desynchronize the peer for good.
"""
from __future__ import annotations

import math
import os
import secrets
import select
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Literal

import trio
import trio.testing

from common import handoff
from mesh import proto
from mesh.errors import single_errors
from mesh.logsafe import clean
from mesh.proto import flow_controlled, frame_cost

DEFAULT_WINDOW = 8 * 1024 * 1024
RECEIVE_SIZE = 256 * 1024
HANDSHAKE_READ = 4096
"""Bytes read at a time before the peer authenticated: a stranger's bytes never take more than this plus one frame."""
PREAUTH_LIMIT = 32
"""Connections one listener lets authenticate at once (`PreAuthGate`); more are closed at once."""
CLOSE_GRACE = 1.0
"""How long a closing link waits to get its final Error or Shutdown frame out before it closes the stream anyway."""
HOT_BLOCK = 0.1
"""The longest a hot link's reader holds the event loop in one blocking wait for its bytes (`Link.hot`)."""
HOT_WINDOW = 0.5
"""A hot link's reader waits for its bytes in blocking waits for this long after `take` last consumed an event."""
SPIN_ENV = "MESH_SPIN_US"
"""Microseconds a hot wait polls its sockets without sleeping before it blocks (default 0: it blocks at once). On a
host with cores to spare (a GPU peer's CPU idles while its stage runs), a reader that never sleeps holds the next
bytes without the wake-up of a halted core, and the writer's `os.write` wakes no one (`SPIN`)."""
_HOT: set = set()       # links whose reader is in `_hot_receive`: one blocking poll watches all of their sockets
_PASSED = -math.inf     # CLOCK_MONOTONIC when a hot wait last let every other task run and trio poll every socket


class LinkError(Exception):
    """Base of every error a Link raises."""


class LinkClosed(LinkError):
    """The link ended: clean EOF, a Shutdown from either side, or the connection was lost."""


class LinkDead(LinkError):
    """The peer sent nothing, not even a Pong, for `dead_after` seconds."""


class _Coded(LinkError):
    def __init__(self, code: proto.ErrorCode, reason: str) -> None:
        super().__init__(f"{code.name}: {reason}")
        self.code = code
        self.reason = reason


class RemoteError(_Coded):
    """The peer sent an Error message. The link stays open unless the peer closes it (then LinkClosed follows)."""


class AuthFailed(_Coded):
    """The handshake failed: wrong or missing fleet token on either side, no common version, or a refusal."""


class ProtocolViolation(_Coded):
    """The peer's bytes broke the protocol; we sent it Error(code, reason) and closed this link."""


class GateFull(LinkError):
    """A listener's PreAuthGate is full: the connection was closed before its handshake."""


class PreAuthGate:
    """How many connections of one listener are between accept and a finished handshake. A connection over the
    limit is closed at once: the cap bounds what strangers can hold (tasks, sockets, buffers), and an honest peer
    that lost the race simply dials again."""

    def __init__(self, limit: int = PREAUTH_LIMIT) -> None:
        self.limit = limit
        self.pending = 0
        self.refused = 0


Role = Literal["client", "server"]


class Link:
    """One authenticated connection. Use through `open_link`."""

    def __init__(self, stream: trio.abc.Stream, *, role: Role, window: int, max_frame: int, ping_interval: float,
                 dead_after: float) -> None:
        if role not in ("client", "server"):
            raise ValueError(f"role must be 'client' or 'server', got {role!r}")
        self.stream = stream
        self.role = role
        self.peer_version: int | None = None
        self._max_frame = max_frame
        self._codec = proto.Codec(max_frame=min(max_frame, proto.HANDSHAKE_MAX_FRAME))   # raised once authenticated
        self._flow = proto.FlowWindow(window, max_frame + proto.SEAL_OVERHEAD)
        self._ping_interval, self._dead_after = ping_interval, dead_after
        self._liveness: proto.Liveness | None = None
        self._send_lock = trio.StrictFIFOLock()
        self._queue: deque[tuple[proto.Event, int]] = deque()
        self._queue_lot = trio.lowlevel.ParkingLot()
        self._credit_lot = trio.lowlevel.ParkingLot()
        self._wake_control = trio.Event()
        self._pong_owed: int | None = None
        self._credit_owed = 0
        self._failure: LinkError | None = None
        self._final_frame: proto.Event | None = None
        self._tail = b""          # what the socket did not take of a frame written by send_nowait: goes out first
        self._sent_shutdown = False
        self._failed = trio.Event()
        self._closed = trio.Event()
        # CLOCK_MONOTONIC (time.perf_counter) when the last bytes were read, the last event decoded and the last
        # frame's write began: one clock for every process of a machine, so a bench lines up a token's hops
        self.arrived = 0.0
        self.decoded = 0.0
        self.wrote = 0.0
        self.hot = False
        """Set by the owner of a link on a decode stream's path (a peer that computes the steps it reads): while
        every other task of this thread is blocked, the reader waits for the next bytes in a blocking poll of the
        socket (at most HOT_BLOCK at a time, never past trio's next deadline, for HOT_WINDOW after the last bytes)
        instead of trio's loop. Measured on 2 busy cores: a receiver asleep in trio's loop holds the bytes ~110-130
        us later than one asleep in a blocking call (bench/RESULTS.md); the loop's pass moves to after the step.
        A link is hot for HOT_WINDOW after `take` consumed an event (a step computed in the reader); other sockets
        of the process wait at most HOT_BLOCK meanwhile. TCP streams only."""
        self.hot_reads = 0        # reads done by the hot wait (`hot`)
        self._pumping = False     # a consumer runs the hot wait for this link now (`pump`)
        self.took = -math.inf     # CLOCK_MONOTONIC when `take` last consumed an event (what keeps a link hot)
        self.take: Callable[[proto.Event], bool] | None = None
        """Called by the reader for each flow-controlled event (not Error) that arrives while the queue is empty,
        as soon as it is decoded, in the reader task: True means the callee consumed it (it is not queued). What a
        hot path hangs here skips one pass of trio's scheduler (the wake-up of the task in `receive`). It must not
        block or raise; it may start work for an event it leaves queued (a peer rings its worker)."""
        self.fast: Callable[[memoryview], bool] | None = None
        self.fast_type = -1
        """`fast`, when set, is called by the reader with the plaintext (type byte first) of a `fast_type` frame
        that arrived whole in one read while nothing was queued, before it is decoded: True means it consumed the
        frame (nothing is decoded or queued); False, that it did nothing (the frame is decoded and goes to `take`
        or the queue). It must not block or raise. A peer's steady decode step (mesh/proto/steady.py)."""

    # ------------------------------------------------------------------------------------------------ public

    @property
    def rtt(self) -> float | None:
        """Round-trip time of the latest answered heartbeat, in seconds."""
        return self._liveness.rtt if self._liveness else None

    async def send(self, event: proto.Event) -> None:
        """Send one event, waiting for flow-control credit first. ValueError if the event cannot be encoded."""
        self._raise_if_failed()
        if self._sent_shutdown:
            raise LinkClosed("this side already sent Shutdown")
        prepared = self._codec.prepare(event)   # a bulk payload stays a buffer of its own: framing does not copy it
        if flow_controlled(event.TYPE):
            while not self._flow.can_send():
                await self._credit_lot.park()
                self._raise_if_failed()
            self._flow.on_sent(frame_cost(prepared.size))
        if isinstance(event, proto.Shutdown):
            self._sent_shutdown = True
        await self._write(prepared)

    def send_nowait(self, event: proto.Event) -> bool:
        """Send one flow-controlled event now, from synchronous code (a `take` hook), if nothing stands in the way
        (`can_send_nowait`). True: it was written; the bytes the socket did not take at once go out, before any
        later frame, from the link's control task. False: nothing was sent (use `send`). Raises what `send` raises
        once the frame was sealed and the connection failed."""
        if not flow_controlled(event.TYPE) or not self.can_send_nowait():
            return False
        prepared = self._codec.prepare(event)
        self._flow.on_sent(frame_cost(prepared.size))
        self._write_now(b"".join(self._codec.frame(prepared)))    # sealed now: the frame must reach the wire
        return True

    def can_send_nowait(self) -> bool:
        """Whether a frame can be written at once from synchronous code: the link is up and a TCP stream, no other
        write is in progress or left unfinished, and there is credit."""
        return self._failure is None and not self._sent_shutdown and not self._send_lock.locked() \
            and not self._tail and self._flow.can_send() and _socket_fd(self.stream) is not None

    def send_plain_nowait(self, plain: bytes) -> None:
        """Seal and write a flow-controlled frame whose plaintext (type byte, payload) the caller wrote
        (mesh/proto/steady.py), right after `can_send_nowait` said it can. ValueError if it is too large."""
        data = self._codec.seal_plain(plain)
        self._flow.on_sent(frame_cost(len(data)))
        self._write_now(data)

    def _write_now(self, data: bytes) -> None:
        fd = _socket_fd(self.stream)
        self.wrote = time.perf_counter()
        try:
            sent = os.write(fd, data)  # type: ignore[arg-type]
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._fail(LinkClosed(f"connection lost while sending: {exc}"))
            raise self._failure.with_traceback(None) from exc  # type: ignore[union-attr]
        if sent < len(data):
            self._tail = data[sent:]
            self._wake_control.set()
        else:       # a hop's frame: the receiver it woke may be queued on this CPU (common/handoff.py)
            handoff.after_wake()

    async def receive(self) -> proto.Event:
        """The next event. Raises RemoteError for an Error from the peer (the link stays usable), LinkClosed on a
        clean end, LinkDead, ProtocolViolation."""
        while not self._queue:
            self._raise_if_failed()
            await self._queue_lot.park()
        event, cost = self._queue.popleft()
        self._consumed(cost)
        if isinstance(event, proto.Error):
            raise RemoteError(event.code, clean(event.reason))
        return event

    async def wait_failed(self) -> LinkError:
        """Wait until the link has failed or closed, and return why. For watchers that do not read the link: a
        registry holding idle peers, a session watching the stages it is not talking to right now."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    async def aclose(self) -> None:
        """Say Shutdown (if the link is still up) and close the stream. Idempotent."""
        if self._failure is None:
            self._fail(LinkClosed("link closed by this side"), final=None if self._sent_shutdown else proto.Shutdown())
        self._queue.clear()
        await self._closed.wait()  # the background task sends the final frame and closes the stream

    # ------------------------------------------------------------------------------------------------ internals

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure.with_traceback(None)

    def _fail(self, exc: LinkError, final: proto.Event | None = None) -> None:
        """Record the first failure, wake everyone waiting, and stop the background tasks (which then close)."""
        if self._failure is not None:
            return
        self._failure = exc
        self._final_frame = final
        self._queue_lot.unpark_all()
        self._credit_lot.unpark_all()
        self._failed.set()

    async def _write(self, *frames: proto.codec.Prepared) -> None:
        """Write prepared frames, each whole. They are sealed here, under the lock, so frame counters follow the
        order in which frames reach the wire."""
        # Uncontended (the usual case) the lock is taken without a trip through the scheduler: on a decode step
        # every such trip is a visible share of a hop's round trip.
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            self._raise_if_failed()
            # Shielded: a frame goes out whole or not at all, because a torn frame desynchronizes the peer for
            # good. What unblocks a write to a peer that stopped reading is the stream being closed, which the
            # background task does on any failure (the watchdog's LinkDead included) and on close.
            parts = [part for f in frames for part in self._codec.frame(f)]
            if self._tail:
                parts.insert(0, self._tail)
                self._tail = b""
            with trio.CancelScope(shield=True):
                self.wrote = time.perf_counter()
                for data in parts:
                    await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail(LinkClosed(f"connection lost while sending: {exc or type(exc).__name__}"))
            raise self._failure.with_traceback(None) from exc  # type: ignore[union-attr]
        finally:
            self._send_lock.release()

    # ---- handshake

    async def _handshake(self, token: bytes | None) -> None:
        nonce = secrets.token_bytes(proto.NONCE_SIZE)
        machine: proto.ClientHandshake | proto.ServerHandshake
        if self.role == "client":
            machine = proto.ClientHandshake(token, nonce)
            await self._write_raw([machine.start()])
        else:
            machine = proto.ServerHandshake(token, nonce)
        try:
            while not machine.done:
                event = await self._next_handshake_event()
                if isinstance(event, proto.Error):
                    raise AuthFailed(event.code, f"the peer refused the handshake: {clean(event.reason)}")
                replies = machine.receive(event)
                keys = machine.keys
                if self.role == "client" and keys is not None and not self._codec.sealed:
                    self._codec.seal(keys.send, keys.receive)   # the client's proof already travels sealed
                if machine.done:
                    self._codec.max_frame = self._max_frame
                    self._liveness = proto.Liveness(trio.current_time(), ping_interval=self._ping_interval,
                                                    dead_after=self._dead_after)
                    replies.append(self._flow.initial_update())
                if replies:
                    await self._write_raw(replies, keys)
        except proto.AuthError as exc:
            await self._send_final(proto.Error(exc.code, exc.reason))
            raise AuthFailed(exc.code, exc.reason) from None
        except proto.ProtocolError as exc:
            await self._send_final(proto.Error(exc.code, exc.reason))
            if exc.code == proto.ErrorCode.AUTH_FAILED:       # a sealed frame that does not open: another token
                raise AuthFailed(exc.code, f"fleet token mismatch ({exc.reason})") from None
            raise ProtocolViolation(exc.code, exc.reason) from None
        self.peer_version = machine.version
        self._codec.version = machine.version  # every later frame carries the negotiated version

    async def _next_handshake_event(self) -> proto.Event:
        while True:
            event = self._codec.next_event()
            if event is proto.EOF:
                raise LinkClosed("the peer closed the connection during the handshake")
            if event is not proto.NEED_DATA:
                return event  # type: ignore[return-value]
            try:
                data = await self.stream.receive_some(HANDSHAKE_READ)
            except trio.BrokenResourceError as exc:
                raise LinkClosed(f"connection lost during the handshake: {exc}") from exc
            self._codec.receive_data(data)

    async def _write_raw(self, events: list[proto.Event], keys: proto.LinkKeys | None = None) -> None:
        """Handshake frames, in one write (a peer on an unbuffered pipe reads them all before it answers). The
        server's Welcome is its last frame in the clear: whatever follows it is sealed."""
        data = []
        for event in events:
            data.append(self._codec.send(event))
            if isinstance(event, proto.Welcome):
                assert keys is not None
                self._codec.seal(keys.send, keys.receive)
        try:
            await self.stream.send_all(b"".join(data))
        except trio.BrokenResourceError as exc:
            raise LinkClosed(f"connection lost during the handshake: {exc}") from exc

    async def _send_final(self, event: proto.Event) -> None:
        """Best effort, bounded: tell the peer why we are closing."""
        with trio.move_on_after(CLOSE_GRACE) as scope:
            scope.shield = True
            try:
                async with self._send_lock:
                    tail, self._tail = self._tail, b""
                    await self.stream.send_all(tail + self._codec.send(event))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    # ---- background

    async def _background(self) -> None:
        async with trio.open_nursery() as workers:
            workers.start_soon(self._reader)
            workers.start_soon(self._control)
            workers.start_soon(self._watchdog)
            try:
                await self._failed.wait()
            finally:
                # Runs on a failure, on aclose(), and when the caller's scope is cancelled. The stream is closed
                # before the workers are cancelled: that is what wakes a shielded write stuck on a silent peer.
                with trio.CancelScope(shield=True):
                    if self._failure is None:
                        self._fail(LinkClosed("link closed by this side"), final=proto.Shutdown())
                    if self._final_frame is not None:
                        await self._send_final(self._final_frame)
                    await trio.aclose_forcefully(self.stream)
                    self._closed.set()
                workers.cancel_scope.cancel()

    async def _reader(self) -> None:
        try:
            going = self._drain()
            while going:
                data = await self._hot_receive() if self.hot else None
                if data is None:
                    data = await self._receive()
                whole = self._whole(data)
                if whole is None:
                    self._received(data)
                    going = self._drain()
                else:
                    going = whole
        except proto.ProtocolError as exc:
            self._fail(ProtocolViolation(exc.code, exc.reason), final=proto.Error(exc.code, exc.reason))
        except trio.BrokenResourceError as exc:
            self._fail(LinkClosed(f"connection lost: {exc or type(exc).__name__}"))
        except trio.ClosedResourceError:
            self._fail(LinkClosed("link closed by this side"))

    async def _receive(self) -> bytes:
        """The stream's next bytes (b"" at its end). A TCP stream is read here, as soon as trio's loop says it is
        readable, and never through `receive_some`: a read that succeeds at once there is followed by a pass of
        the scheduler with the bytes in hand, and a `pump` of this link that runs then reads and handles the bytes
        that came after them first: frames out of order, and a sealed link fails (AUTH_FAILED, "sealed frame N does
        not open": seen in CI on the coordinator's sink, whose decode loop pumps it)."""
        fd = _read_fd(self.stream)
        if fd is None:
            return await self.stream.receive_some(RECEIVE_SIZE)
        if fd < 0:
            raise trio.ClosedResourceError("the socket was closed")
        while True:     # a close while waiting wakes the wait with ClosedResourceError (trio's notify_closing)
            await trio.lowlevel.wait_readable(fd)
            try:
                return os.read(fd, RECEIVE_SIZE)
            except BlockingIOError:     # the pump took them
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc

    def _received(self, data: bytes) -> None:
        self.arrived = time.perf_counter()
        self._liveness.on_receive(trio.current_time())  # type: ignore[union-attr]
        self._codec.receive_data(data)

    async def pump(self) -> bool:
        """The hot wait (`hot`) run by the task that wants this link's next event, not by its reader: for a
        consumer that gets its events from `take` (the coordinator's sink hands each Done to its decode loop).
        While that consumer waits, the bytes are read by a blocking poll in its own task and handled here (decoded,
        `take` called, anything else queued for `receive`), so the event reaches it without the reader task's
        wake-up through trio's loop and the scheduler pass to the consumer. True: bytes were read and handled
        (look again for the event); False: nothing read (the link is not hot now: no `take` for HOT_WINDOW, not a
        TCP stream, something else of the thread is due, it failed): wait the usual way. The reader task stays
        parked in its socket wait (`_receive`) meanwhile and finds nothing to read, or reads what came later; a
        failure or EOF found here is recorded as the reader would."""
        if self._failure is not None:
            return False
        data = await self._hot_receive(pumped=True)
        if data is None or self._failure is not None:
            return False
        try:
            if self._whole(data) is None:
                self._received(data)
                self._drain()
        except proto.ProtocolError as exc:
            self._fail(ProtocolViolation(exc.code, exc.reason), final=proto.Error(exc.code, exc.reason))
        return True

    async def _hot_receive(self, pumped: bool = False) -> bytes | None:
        """The next bytes through a blocking poll of the socket while nothing else of this thread is due (`hot`),
        or None: not hot now (no step taken for HOT_WINDOW, a task that keeps running, not a socket) or the socket
        has something else to say (trio's receive reports it). Whenever a task is runnable, a deadline is due or
        something else is ready (another socket trio waits on, trio's wake-up socket, another hot link's bytes),
        every other task runs and trio's loop polls every socket first, then the wait goes on. The poll watches
        every socket trio's loop waits on (`_trio_waits`), so nothing waits behind it; where that cannot be read
        (trio on kqueue or IOCP, another trio version), only the hot links' sockets, and the loop polls every
        socket at least every HOT_BLOCK."""
        global _PASSED
        if not hasattr(select, "poll"):     # Windows: trio's own wait
            return None
        _HOT.add(self)
        self._pumping = pumped
        arrived = self.arrived
        others_ready = False
        # A pump blocks only after one pass of trio's loop (`wait_all_tasks_blocked`) since it was called: a task
        # woken in the same batch as the consumer is neither in trio's run queue (`tasks_runnable` does not count
        # the rest of the batch being run) nor in its socket waits, so the poll could not see it, and a token that
        # needs that task (a peer of this process reading the next step) waited until the poll's deadline: one
        # stream through serve_bench's in-process chain ran at 5-12 tok/s instead of ~165 (2026-12-04). Bytes
        # already there are still read without the pass (a poll that does not block first).
        passed = not pumped
        try:
            while (self.hot or pumped) and self._failure is None:
                now = time.perf_counter()
                fd = _read_fd(self.stream)
                if now - self.took >= HOT_WINDOW or fd is None or fd < 0:
                    return None
                stats = trio.lowlevel.current_statistics()
                waits = _trio_waits()
                if others_ready or stats.tasks_runnable or stats.seconds_to_next_deadline <= 0 or \
                        (waits is None and now - _PASSED >= HOT_BLOCK):
                    others_ready = False
                    # a task that keeps running (another link's transfer) sends this read back to trio's own wait
                    with trio.move_on_after(HOT_BLOCK) as busy:
                        await trio.testing.wait_all_tasks_blocked()
                    passed = True
                    if busy.cancelled_caught or (pumped and self.arrived != arrived):
                        return None     # (pumped: the reader read meanwhile; the consumer looks at what it got)
                    now = _PASSED = time.perf_counter()
                    stats = trio.lowlevel.current_statistics()
                    waits = _trio_waits()
                block = min(HOT_WINDOW - (now - self.took), stats.seconds_to_next_deadline,
                            _PASSED + HOT_BLOCK - now if waits is None else HOT_WINDOW)
                hot = {f for link in _HOT if (link.hot or link._pumping) and link._failure is None
                       and now - link.took < HOT_WINDOW
                       and (f := _socket_fd(link.stream)) is not None and f >= 0}
                if block <= 0 or fd not in hot:
                    return None
                poller = select.poll()
                for other, events in waits or ():
                    if other not in hot:
                        poller.register(other, events)
                for other in hot:
                    poller.register(other, select.POLLIN)
                ready = _spin(poller, min(SPIN, block)) if SPIN > 0 else None
                if not ready and not passed:
                    ready = poller.poll(0)
                    if not ready:
                        others_ready = True     # nothing yet: the pass first, then the blocking poll
                        continue
                if not ready:
                    ready = poller.poll(max(0.0, block - (time.perf_counter() - now)) * 1e3)
                if not ready:
                    continue
                if any(r != fd for r, _ in ready):      # trio's loop takes those first, then this wait goes on
                    others_ready = True
                    continue
                try:
                    data = os.read(fd, RECEIVE_SIZE)
                    self.hot_reads += bool(data)
                    return data or None    # EOF (b""): trio's receive says it
                except OSError:     # BlockingIOError, or a broken connection: trio's receive reports it
                    return None
            return None
        finally:
            _HOT.discard(self)
            self._pumping = False

    def _drain(self) -> bool:
        """Handle every buffered event; False once the link has ended."""
        while True:
            event = self._codec.next_event()
            if event is proto.NEED_DATA:
                return True
            if event is proto.EOF:
                self._fail(LinkClosed("the peer closed the connection"))
                return False
            if not self._handle(event, frame_cost(self._codec.last_size)):
                return False

    def _whole(self, data: bytes) -> bool | None:
        """`data` read while nothing was buffered, when it is exactly one sealed frame (`Codec.open_whole`; most
        reads on a decode stream's path): opened and decoded without the codec's buffering and second header
        check, or, a `fast_type` frame, offered to `fast` undecoded; what `fast` leaves is decoded and handled as
        `_drain` handles it. True: handled; False: handled, and the link has ended; None: not such a chunk
        (nothing done: `_received` and `_drain` take it)."""
        if self._queue:
            return None
        plain = self._codec.open_whole(data)
        if plain is None:
            return None
        self.arrived = time.perf_counter()
        self._liveness.on_receive(trio.current_time())  # type: ignore[union-attr]
        cost = frame_cost(len(data))
        if plain[0] == self.fast_type and self.fast is not None:
            self._flow.on_received(cost)
            self.decoded = self.arrived
            if self.fast(plain):   # type: ignore[misc]
                self.took = self.decoded
                self._consumed(cost)
                return True
            return self._deliver(self._codec.decode_opened(plain), cost)
        return self._handle(self._codec.decode_opened(plain), cost)

    def _handle(self, event: proto.Event, cost: int) -> bool:
        """Act on one decoded event (answer, apply, or queue it); False once the link has ended."""
        if isinstance(event, proto.Ping):
            self._pong_owed = event.nonce
            self._wake_control.set()
        elif isinstance(event, proto.Pong):
            self._liveness.on_pong(event.nonce, trio.current_time())  # type: ignore[union-attr]
        elif isinstance(event, proto.WindowUpdate):
            self._flow.on_window_update(event)
            self._credit_lot.unpark_all()
        elif isinstance(event, proto.Shutdown):
            self._fail(LinkClosed("the peer shut the link down"))
            return False
        elif not flow_controlled(event.TYPE):
            raise proto.ProtocolError(proto.ErrorCode.UNEXPECTED,
                                      f"{type(event).__name__} after the handshake is complete")
        else:
            try:
                self._flow.on_received(cost)
            except proto.ProtocolError:
                if not isinstance(event, proto.Error):
                    raise
                # A peer may send its last word beyond its credit: it closes right after. Keep it, stop reading.
                self._queue.append((event, 0))
                self._fail(LinkClosed("the peer closed the link after an error"))
                return False
            self.decoded = time.perf_counter()
            return self._deliver(event, cost)
        return True

    def _deliver(self, event: proto.Event, cost: int) -> bool:
        """A flow-controlled event, counted: to `take`, else to the queue."""
        if self.take is not None and not self._queue and not isinstance(event, proto.Error) and self.take(event):
            self.took = self.decoded
            self._consumed(cost)
        else:
            self._queue.append((event, cost))
            self._queue_lot.unpark()
        return True

    def _consumed(self, cost: int) -> None:
        update = self._flow.on_consumed(cost)
        if update is not None:
            self._credit_owed += update.credit
            self._wake_control.set()

    async def _control(self) -> None:
        liveness = self._liveness
        assert liveness is not None
        while True:
            self._wake_control = trio.Event()
            owed: list[proto.Event] = []
            if self._pong_owed is not None:
                owed.append(proto.Pong(self._pong_owed))
                self._pong_owed = None
            if self._credit_owed:
                owed.append(proto.WindowUpdate(self._credit_owed))
                self._credit_owed = 0
            ping = liveness.ping_due(trio.current_time())
            if ping is not None:
                owed.append(ping)
            if owed or self._tail:        # _write sends the tail of a send_nowait frame first
                try:
                    await self._write(*map(self._codec.prepare, owed))
                except LinkError:
                    return
            with trio.move_on_at(liveness.next_ping_at):
                await self._wake_control.wait()

    async def _watchdog(self) -> None:
        liveness = self._liveness
        assert liveness is not None
        while not liveness.is_dead(trio.current_time()):
            await trio.sleep_until(liveness.dead_at())
        self._fail(LinkDead(f"nothing received from the peer for {self._dead_after:g}s"))


def _trio_waits() -> list[tuple[int, int]] | None:
    """(fd, poll events) of every socket trio's loop waits on now, its wake-up socket (threads, signals) included;
    None where trio's loop is not its epoll one (kqueue, IOCP) or looks different (trio's internals: checked
    against trio 0.35's EpollIOManager; tests/test_link.py fails when they change)."""
    try:
        io = trio._core._run.GLOBAL_RUN_CONTEXT.runner.io_manager
        registered, wake = io._registered, io._force_wakeup_fd
    except AttributeError:
        return None
    waits = [(wake, select.POLLIN)]
    for fd, w in list(registered.items()):
        events = (select.POLLIN if w.read_task is not None else 0) | (select.POLLOUT if w.write_task is not None else 0)
        if events:
            waits.append((fd, events))
    return waits


def hot_waits_all() -> bool:
    """Whether a hot wait (`Link.hot`) in this trio run watches every socket the loop waits on (trio's epoll loop)."""
    return hasattr(select, "poll") and _trio_waits() is not None


def spin_from_env(env=os.environ) -> float:
    """$MESH_SPIN_US as seconds (0 if unset). A bad value is an error that names the variable."""
    raw = env.get(SPIN_ENV, "")
    try:
        us = float(raw) if raw else 0.0
    except ValueError:
        us = -1.0
    if not 0 <= us < 1e7:
        raise ValueError(f"{SPIN_ENV}={raw!r}: expected microseconds, a number from 0 to 1e7")
    return us * 1e-6


try:
    SPIN = spin_from_env()
    """How long a hot wait spins before it blocks, in seconds ($MESH_SPIN_US when the module loads; a process may
    set it later: the bench does for its coordinator)."""
except ValueError:
    SPIN = 0.0          # the commands say what is wrong with it at start (mesh/cli.py), before any link exists


def _spin(poller, seconds: float) -> list:
    """Poll without sleeping for up to `seconds`; what became ready, or [] (then the caller blocks)."""
    until = time.perf_counter() + seconds
    while True:
        ready = poller.poll(0)
        if ready or time.perf_counter() >= until:
            return ready


def _socket_fd(stream) -> int | None:
    """The fd of a TCP stream that `send_nowait` may write to directly (a trio SocketStream, also behind the
    listener's PrefixStream); None for anything else (WebSocket, WebRTC, memory streams)."""
    if type(stream) is not trio.SocketStream:
        stream = getattr(stream, "transport_stream", None)
        if type(stream) is not trio.SocketStream:
            return None
    return stream.socket.fileno()


def _read_fd(stream) -> int | None:
    """The fd a TCP stream is read from directly (`_receive`, the hot wait); None for anything else, and while a
    listener's PrefixStream still holds bytes it peeked at (they come first)."""
    return None if getattr(stream, "prefix_left", 0) else _socket_fd(stream)


@asynccontextmanager
async def open_link(stream: trio.abc.Stream, *, token: bytes | None, role: Role, window: int = DEFAULT_WINDOW,
                    max_frame: int = proto.MAX_FRAME, ping_interval: float = 1.0, dead_after: float = 5.0,
                    gate: PreAuthGate | None = None) -> AsyncIterator[Link]:
    """Handshake on `stream`, then yield a running Link; on exit say Shutdown and close the stream.

    Raises AuthFailed, ProtocolViolation or LinkClosed if the handshake fails (the stream is closed then too), and
    GateFull when `gate` (a listener's cap on connections still authenticating) is full.
    `window` is how many bytes of flow-controlled frames this side is willing to buffer from the peer.
    """
    if not 0 < ping_interval < dead_after or not math.isfinite(dead_after):
        raise ValueError(f"need 0 < ping_interval ({ping_interval}) < dead_after ({dead_after}) < inf")
    if gate is not None and gate.pending >= gate.limit:
        gate.refused += 1
        await trio.aclose_forcefully(stream)
        raise GateFull(f"{gate.pending} connections are already authenticating; closed this one")
    link = Link(stream, role=role, window=window, max_frame=max_frame, ping_interval=ping_interval,
                dead_after=dead_after)
    if gate is not None:
        gate.pending += 1
    try:
        await link._handshake(token)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    finally:
        if gate is not None:
            gate.pending -= 1
    # The background task records failures instead of raising, so whatever leaves this nursery came from the
    # caller's body: hand it back as itself, not wrapped in an exception group that `except LinkError` would miss.
    with single_errors():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link._background)
            try:
                yield link
            finally:
                await link.aclose()
