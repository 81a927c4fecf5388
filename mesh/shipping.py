"""Weight shipping: the coordinator streams a range-only GGUF to a modelless peer, resumably, into the peer's cache.

Wire exchange (events from `mesh.proto`):

    sender                                  receiver
    ShipBegin(fp, start, end, total, sha) ->
                                         <- ShipResume(offset)   bytes already on disk, re-hashed
                                            | Error(BUSY)         another shipper holds the target
    ShipChunk(offset, data) x N          ->                      (the Link's credit window bounds what is in flight)
                                         <- Error(code, reason)  at most once, if the receiver fails mid-way
    ShipEnd(sha256)                      ->
                                         <- Ack(SHIP_END, code)  0: verified and renamed into place

Cache layout (`ShipCache`): `<root>/<fingerprint>/<start>-<end>.gguf` is a complete entry; while shipping, the
bytes land in `<start>-<end>.gguf.part` beside it, with `<start>-<end>.gguf.part.want` naming the content the
partial belongs to (sha256 and size), so a partial of other bytes is never resumed. A dropped connection keeps the
partial; the next ShipBegin re-hashes it and resumes at its end. The SHA-256 over the whole file, accumulated
across resumes, is checked before fsync + os.replace; a mismatch discards the partial and the sender re-ships from
zero once. One shipper per target: an in-process claim registry plus `fcntl.flock` on the partial (two
coordinators, or two processes sharing one cache) -- the second is refused BUSY until the first lets go.

`ShipReceiver` is the receiver's logic, sans-IO: fed events, it returns the event to send back; its only I/O is the
cache directory (chunks through an injectable `write`), and it hashes on a helper thread so that hashing overlaps
receiving. `serve_ship` and `ship_range` are the trio glue over a Link.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import logging
import math
import os
import queue
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TextIO

import trio

from engine.gguf_range import (CHUNK_BYTES, KEY_FINGERPRINT, KEY_RANGE_END, KEY_RANGE_START, RangeGGUFError,
                               RangePlan, plan_range_gguf, range_file_name, read_source_header)
from mesh import proto
from mesh.errors import MeshError, single_errors
from mesh.link import RemoteError

__all__ = [
    "ShipAck",
    "ShipError",
    "ShipBusy",
    "ShipFailed",
    "ShipCache",
    "ShipReceiver",
    "ShipProgress",
    "ProgressBoard",
    "ShipResult",
    "default_cache_dir",
    "complete_entry",
    "cached_ranges",
    "serve_ship",
    "ship_range",
]

log = logging.getLogger("mesh.shipping")
ErrorCode = proto.ErrorCode
READ_AHEAD = 4  # chunks the sender reads per trip to a worker thread
_ENTRY_RE = re.compile(r"^(\d+)-(\d+)\.gguf$")
_FINGERPRINT_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")  # one safe path component


class ShipAck(IntEnum):
    """`Ack(of=SHIP_END).code` values."""

    OK = 0
    TRUNCATED = 1      # ShipEnd came before every byte did; the partial is kept for a resume
    HASH_MISMATCH = 2  # the bytes on disk do not hash to the announced sha256; the partial is discarded


class ShipError(MeshError):
    """A shipment failed; `code` is the wire ErrorCode that reports it, the message names the target and reason."""

    def __init__(self, reason: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class ShipBusy(ShipError):
    """Another shipper holds this target; retry once it lets go."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, ErrorCode.BUSY)


class ShipFailed(ShipError):
    """The receiver refused or failed the shipment (it said why), or the sender's source failed."""


# --------------------------------------------------------------------------------------------------- the cache


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/mesh, else ~/.cache/mesh."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "mesh"


def _check_fingerprint(fingerprint: str) -> str:
    if not isinstance(fingerprint, str) or not _FINGERPRINT_RE.match(fingerprint):
        raise ShipError(f"fingerprint {fingerprint!r} is not a safe cache directory name", ErrorCode.BAD_REQUEST)
    return fingerprint


class ShipCache:
    """Paths of the shipped-weights cache under `root`."""

    __slots__ = ("root",)

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"ShipCache({str(self.root)!r})"

    def entry(self, fingerprint: str, start: int, end: int) -> Path:
        return self.root / _check_fingerprint(fingerprint) / range_file_name(start, end)

    def part(self, fingerprint: str, start: int, end: int) -> Path:
        return self.entry(fingerprint, start, end).with_name(range_file_name(start, end) + ".part")

    def complete(self, fingerprint: str, start: int, end: int) -> Path | None:
        """The complete entry for this model and range, or None. The file must say it is that model's range."""
        try:
            path = self.entry(fingerprint, start, end)
        except ShipError:
            return None
        if not path.is_file():
            return None
        try:
            kv = read_source_header(path).kv_values
        except RangeGGUFError as exc:
            log.warning("ignoring unreadable cache entry %s: %s", path, exc)
            return None
        if (kv.get(KEY_FINGERPRINT), kv.get(KEY_RANGE_START), kv.get(KEY_RANGE_END)) != (fingerprint, start, end):
            log.warning("ignoring cache entry %s: it holds %s layers %s..%s", path, kv.get(KEY_FINGERPRINT),
                        kv.get(KEY_RANGE_START), kv.get(KEY_RANGE_END))
            return None
        return path


    def ranges(self, fingerprint: str) -> list[tuple[int, int]]:
        """Layer ranges of this model with a complete entry here, sorted."""
        try:
            folder = self.root / _check_fingerprint(fingerprint)
            names = [p.name for p in folder.iterdir()]
        except (ShipError, OSError):
            return []
        found = []
        for name in names:
            m = _ENTRY_RE.match(name)
            if m and self.complete(fingerprint, int(m[1]), int(m[2])) is not None:
                found.append((int(m[1]), int(m[2])))
        return sorted(found)


def complete_entry(root: str | os.PathLike, fingerprint: str, start: int, end: int) -> Path | None:
    """The cached range file a Load can use without shipping, or None."""
    return ShipCache(root).complete(fingerprint, start, end)


def cached_ranges(root: str | os.PathLike, fingerprint: str) -> list[tuple[int, int]]:
    """Ranges of this model a peer already holds in its cache (a planner can prefer them to shipping again)."""
    return ShipCache(root).ranges(fingerprint)


# One shipper per target within this process; fcntl.flock covers other processes.
_claims: set[Path] = set()
_claims_lock = threading.Lock()


def _hash_file(fd: int, upto: int, h: hashlib._Hash, chunk: int = 4 * CHUNK_BYTES) -> int:
    pos = 0
    while pos < upto:
        got = os.pread(fd, min(chunk, upto - pos), pos)
        if not got:
            break
        h.update(got)
        pos += len(got)
    return pos


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------- receiver


class _BackgroundHash:
    """A SHA-256 fed through a short queue to one helper thread.

    hashlib releases the GIL on large buffers, so hashing chunk N overlaps writing chunk N+1 and the Link decoding
    chunk N+2: the receiver then runs at the pace of its slowest stage instead of the sum of them (measured in
    NOTES.md "Weight shipping").
    """

    def __init__(self, h: hashlib._Hash, depth: int = 4) -> None:
        self._h = h
        self._queue: queue.Queue[bytes | None] = queue.Queue(depth)
        self._thread = threading.Thread(target=self._run, name="ship-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            self._h.update(data)

    def update(self, data: bytes) -> None:
        self._queue.put(data)

    def digest(self) -> bytes:
        self.stop()
        return self._h.digest()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


WriteFn = Callable[[int, memoryview], int]


class ShipReceiver:
    """One incoming shipment into a cache, sans-IO: `receive(event)` returns the event to send back, or None.

    After the answer to ShipEnd, or after a ShipBegin refusal, `done` is set. Chunks after a mid-way failure are
    dropped until ShipEnd closes the exchange. `close()` releases the claim and the lock and keeps the partial.
    """

    def __init__(self, cache: ShipCache | str | os.PathLike, *, write: WriteFn = os.write) -> None:
        self.cache = cache if isinstance(cache, ShipCache) else ShipCache(cache)
        self._write = write
        self.begin_event: proto.ShipBegin | None = None
        self.path: Path | None = None       # the complete entry, once committed
        self.part: Path | None = None
        self.resumed_at = 0
        self.pos = 0
        self.failed: ShipError | None = None
        self.done = False
        self._fd: int | None = None
        self._claim: Path | None = None
        self._hash = hashlib.sha256()
        self._hasher: _BackgroundHash | None = None
        self._complete_already = False

    # The sans-IO entry point.
    def receive(self, ev: proto.Event) -> proto.Event | None:
        if self.done:
            raise ShipError(f"{type(ev).__name__} after the shipment finished", ErrorCode.UNEXPECTED)
        if isinstance(ev, proto.ShipBegin) and self.begin_event is None:
            try:
                return proto.ShipResume(self.begin(ev))
            except ShipError as exc:
                self.done = True
                self.close()
                return proto.Error(exc.code, exc.reason)
        if self.begin_event is None:
            self.done = True
            return proto.Error(ErrorCode.UNEXPECTED, f"{type(ev).__name__} before ShipBegin")
        if isinstance(ev, proto.ShipChunk):
            if self.failed is not None:
                return None
            try:
                self.chunk(ev)
            except ShipError as exc:
                self.failed = exc
                self.close()
                return proto.Error(exc.code, exc.reason)
            return None
        if isinstance(ev, proto.ShipEnd):
            self.done = True
            if self.failed is not None:
                return None  # the Error already answered this shipment
            try:
                return self.end(ev)
            except ShipError as exc:  # the commit itself failed (fsync, rename)
                return proto.Error(exc.code, exc.reason)
            finally:
                self.close()
        self.done = True
        self.close()
        return proto.Error(ErrorCode.UNEXPECTED, f"{type(ev).__name__} in the middle of a shipment")

    # The steps, each raising ShipError with the code to report.
    def begin(self, ev: proto.ShipBegin) -> int:
        """Claim the target, reconcile what is on disk with what is announced; return the offset to resume at."""
        self.begin_event = ev
        fp, start, end = ev.fingerprint, ev.start, ev.end
        what = f"layers {start}..{end} of {fp[:16]}"
        if not 0 <= start < end:
            raise ShipError(f"ship of {what}: empty or negative layer range", ErrorCode.BAD_REQUEST)
        if ev.name != range_file_name(start, end):
            raise ShipError(f"ship of {what}: file name {ev.name!r} is not {range_file_name(start, end)!r}",
                            ErrorCode.BAD_REQUEST)
        if ev.total_bytes <= 0:
            raise ShipError(f"ship of {what}: total size {ev.total_bytes} is not positive", ErrorCode.BAD_REQUEST)
        entry, part = self.cache.entry(fp, start, end), self.cache.part(fp, start, end)
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ShipError(f"cache dir {entry.parent} is not writable: {exc.strerror or exc}") from None
        self.part = part
        self._claim_target(part)
        self._fd = self._open_locked(part)

        if entry.is_file() and entry.stat().st_size == ev.total_bytes:
            # A complete entry with the announced content: nothing to ship. Hashing it costs one read, and only
            # happens when a Load did not already accept the entry.
            h = hashlib.sha256()
            fd = os.open(entry, os.O_RDONLY)
            try:
                _hash_file(fd, ev.total_bytes, h)
            finally:
                os.close(fd)
            if h.digest() == ev.sha256:
                if os.fstat(self._fd).st_size == 0:
                    self._unlink(part)  # we created it only to hold the lock
                self._complete_already = True
                self.path = entry
                self.pos = self.resumed_at = ev.total_bytes
                return self.pos

        want = f"{ev.sha256.hex()} {ev.total_bytes}\n"
        want_path = part.with_name(part.name + ".want")
        size = os.fstat(self._fd).st_size
        try:
            recorded = want_path.read_text()
        except (OSError, UnicodeDecodeError):
            recorded = None
        try:
            if recorded != want or size > ev.total_bytes:
                if size:
                    log.info("discarding partial %s: it holds other bytes than the ones announced", part)
                os.ftruncate(self._fd, 0)
                size = 0
                tmp = want_path.with_name(want_path.name + ".tmp")
                tmp.write_text(want)
                os.replace(tmp, want_path)
            self.pos = self.resumed_at = _hash_file(self._fd, size, self._hash)
            os.lseek(self._fd, self.pos, os.SEEK_SET)
        except OSError as exc:
            raise ShipError(f"cache dir {entry.parent}: cannot prepare {part.name}: {exc.strerror or exc}") from None
        return self.pos

    def chunk(self, ev: proto.ShipChunk) -> None:
        b = self.begin_event
        assert b is not None
        if self._complete_already:
            raise ShipError(f"chunk for {self._name()}, which is already complete", ErrorCode.UNEXPECTED)
        if ev.offset != self.pos:
            raise ShipError(f"chunk at offset {ev.offset}, expected {self.pos} for {self._name()}",
                            ErrorCode.BAD_REQUEST)
        if self.pos + len(ev.data) > b.total_bytes:
            raise ShipError(f"chunk overruns {self._name()}: {self.pos}+{len(ev.data)} > {b.total_bytes} bytes",
                            ErrorCode.BAD_REQUEST)
        view = memoryview(ev.data)
        try:
            while view:
                n = self._write(self._fd, view)
                view = view[n:]
        except OSError as exc:
            why = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
            raise ShipError(f"writing {self.part} at byte {self.pos}: {why}; the partial is kept") from None
        if self._hasher is None:
            self._hasher = _BackgroundHash(self._hash)
        self._hasher.update(ev.data)
        self.pos += len(ev.data)

    def end(self, ev: proto.ShipEnd) -> proto.Ack:
        b = self.begin_event
        assert b is not None
        if self._complete_already:
            ok = ev.sha256 == b.sha256
            return proto.Ack(proto.MsgType.SHIP_END, ShipAck.OK if ok else ShipAck.HASH_MISMATCH,
                             "" if ok else f"ShipEnd sha256 differs from ShipBegin's for {self._name()}")
        if self.pos < b.total_bytes:
            return proto.Ack(proto.MsgType.SHIP_END, ShipAck.TRUNCATED,
                             f"{self._name()}: received {self.pos} of {b.total_bytes} bytes; the partial is kept")
        digest = self._hasher.digest() if self._hasher is not None else self._hash.digest()
        if digest != b.sha256 or ev.sha256 != b.sha256:
            self._discard()
            return proto.Ack(proto.MsgType.SHIP_END, ShipAck.HASH_MISMATCH,
                             f"{self._name()}: sha256 {digest.hex()[:16]} of the received bytes is not the announced "
                             f"{b.sha256.hex()[:16]}; the partial is discarded")
        entry = self.cache.entry(b.fingerprint, b.start, b.end)
        try:
            os.fsync(self._fd)
            os.replace(self.part, entry)
            _fsync_dir(entry.parent)
        except OSError as exc:
            raise ShipError(f"committing {entry}: {exc.strerror or exc}") from None
        self._unlink(self.part.with_name(self.part.name + ".want"))
        self.path = entry
        return proto.Ack(proto.MsgType.SHIP_END, ShipAck.OK, "")

    def close(self) -> None:
        """Release the lock and the claim; the partial stays for a resume. Idempotent."""
        if self._hasher is not None:
            self._hasher.stop()
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops its flock
            self._fd = None
        if self._claim is not None:
            with _claims_lock:
                _claims.discard(self._claim)
            self._claim = None

    def __enter__(self) -> ShipReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _name(self) -> str:
        b = self.begin_event
        return f"{b.fingerprint[:16]}/{b.name}" if b else "shipment"

    def _claim_target(self, part: Path) -> None:
        key = part.resolve()
        with _claims_lock:
            if key in _claims:
                raise ShipBusy(f"{self._name()} is being shipped by another connection; retry when it finishes")
            _claims.add(key)
        self._claim = key

    def _open_locked(self, part: Path) -> int:
        for _ in range(8):  # retry when a previous holder renamed the partial between our open and our lock
            try:
                fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ShipError(f"cache dir {part.parent} is not writable: {exc.strerror or exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ShipBusy(f"{self._name()} is being shipped by another process; retry when it finishes") \
                    from None
            try:
                same = os.stat(part).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)
        raise ShipBusy(f"{self._name()}: the partial keeps changing under us; retry")

    def _discard(self) -> None:
        if self.part is not None:
            self._unlink(self.part)
            self._unlink(self.part.with_name(self.part.name + ".want"))

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------------------------------- progress


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass
class ShipProgress:
    """Bytes, rate and ETA of one shipment; time comes in as an argument."""

    label: str
    total: int
    started: float
    resumed_at: int = 0
    done: int = 0
    now: float = 0.0

    def update(self, done: int, now: float) -> None:
        self.done, self.now = done, now

    @property
    def rate(self) -> float:
        """Bytes per second that actually crossed the wire in this session."""
        dt = self.now - self.started
        return (self.done - self.resumed_at) / dt if dt > 0 else 0.0

    def line(self) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        rate = self.rate
        eta = _clock((self.total - self.done) / rate) if rate > 0 else "?"
        resumed = f", resumed at {_mb(self.resumed_at)} MB" if self.resumed_at else ""
        return (f"{self.label}: {_mb(self.done)}/{_mb(self.total)} MB {pct:5.1f}% "
                f"{rate / 1e6:7.1f} MB/s ETA {eta}{resumed}")


class ProgressBoard:
    """A tqdm bar per shipment (mesh.console.bar): redrawn in place on a terminal, one bar per line while several
    run; on a pipe, plain lines at most every few seconds and the last one."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None, delay: float = 1.0) -> None:
        self.stream, self.tty, self.delay = stream, tty, delay     # a shipment done within `delay` shows no bar
        self._bars: dict[int, object] = {}

    def update(self, p: ShipProgress, *, final: bool = False) -> None:
        from mesh.console import bar
        b = self._bars.get(id(p))
        if b is None:
            b = self._bars[id(p)] = bar(p.label, total=p.total, initial=p.resumed_at, stream=self.stream,
                                        tty=self.tty, delay=self.delay)
        b.update(p.done - b.n)
        if final:
            b.close()
            del self._bars[id(p)]


_board: ProgressBoard | None = None


def _default_board() -> ProgressBoard:
    global _board
    if _board is None:
        _board = ProgressBoard()
    return _board


# --------------------------------------------------------------------------------------------------- trio glue


@dataclass(frozen=True, slots=True)
class ShipResult:
    fingerprint: str
    start: int
    end: int
    total_bytes: int
    resumed_at: int      # bytes the receiver already held when the last attempt began
    sent_bytes: int      # chunk bytes that crossed the wire, over every attempt
    attempts: int
    seconds: float


SINK_DEPTH = 4
"""Received events handed to the receiver's writer thread and not yet handled by it. With the Link's window this
bounds what a receiver holds; when the disk is slower than the wire, back-pressure reaches the sender as credit."""


class _Sink:
    """Runs `ShipReceiver.receive` on one worker thread for a whole shipment, fed without a round trip per event.

    A `trio.to_thread` round trip per 1 MiB chunk cost about 1.5 ms of wall time on two busy cores (the write itself
    about 0.3), and the receive loop waited for each one. Here the loop only queues events (at most `depth`
    outstanding) and goes back to the Link; the thread answers through trio's token, and only events that have an
    answer (an Error, the verdict on ShipEnd) reach `replies` as `(event, reply)`, `reply` possibly an exception.
    The receiver's logic and its order are unchanged: every event still goes through `receive`, one at a time.
    """

    def __init__(self, rx: ShipReceiver, depth: int = SINK_DEPTH) -> None:
        self._rx = rx
        self._queue: queue.SimpleQueue[proto.Event | None] = queue.SimpleQueue()
        self._slots = trio.Semaphore(depth)
        self._token = trio.lowlevel.current_trio_token()
        self._send, self.replies = trio.open_memory_channel(math.inf)

    def run(self) -> None:
        """The worker thread's loop, until `stop()`: the events queued before it are all handled first."""
        while (ev := self._queue.get()) is not None:
            try:
                reply: object = self._rx.receive(ev)
            except BaseException as exc:  # handed to the trio side, which raises it
                reply = exc
            self._token.run_sync_soon(self._answered, ev, reply)
            if isinstance(reply, BaseException):
                return

    def _answered(self, ev: proto.Event, reply: object) -> None:
        # Runs on the trio thread (run_sync_soon), where raising would crash the run: it never raises.
        self._slots.release()
        if reply is not None or not isinstance(ev, proto.ShipChunk):
            try:
                self._send.send_nowait((ev, reply))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # serve_ship already gave up on this shipment

    async def put(self, ev: proto.Event) -> None:
        await self._slots.acquire()
        self._queue.put(ev)

    def stop(self) -> None:
        self._queue.put(None)


async def serve_ship(link, begin: proto.ShipBegin, cache: ShipCache | str | os.PathLike, *,
                     write: WriteFn = os.write, progress_stream: TextIO | None = None) -> Path | None:
    """Receive one shipment whose ShipBegin the caller has already read from `link`.

    Returns the complete entry's path, or None when the shipment was refused or failed (the sender was told why,
    and the reason is logged). Link errors propagate; the partial stays on disk for a resume either way.
    Progress: a bar on `progress_stream` (stderr; mesh.console).
    """
    rx = ShipReceiver(cache, write=write)
    shown = None
    what = f"layers {begin.start}..{begin.end} of {begin.fingerprint[:16]}"
    try:
        reply = await trio.to_thread.run_sync(rx.receive, begin)
        await link.send(reply)
        if isinstance(reply, proto.Error):
            log.warning("ship of %s refused: %s", what, reply.reason)
            return None
        now = trio.current_time()
        progress = ShipProgress(f"receiving {what}", begin.total_bytes, now, rx.resumed_at, rx.resumed_at, now)
        from mesh.console import bar
        shown = bar(f"receiving {what}", total=begin.total_bytes, initial=rx.resumed_at, stream=progress_stream,
                    delay=1.0)
        log.info("ship of %s: %s", what, "already complete" if rx.resumed_at == begin.total_bytes
                 else f"resuming at {_mb(rx.resumed_at)} of {_mb(begin.total_bytes)} MB" if rx.resumed_at
                 else f"receiving {_mb(begin.total_bytes)} MB")
        # Chunks are written (and ShipEnd verified, fsynced, renamed) on the sink's thread, so the Link's reader
        # keeps receiving while the kernel copies a chunk into the page cache: inline, the two took turns.
        sink = _Sink(rx)
        verdict: list[object] = []

        async def relay() -> None:
            async for ev, answer in sink.replies:
                if isinstance(answer, BaseException):
                    raise answer
                if answer is not None:
                    await link.send(answer)
                if isinstance(answer, proto.Error):
                    log.warning("ship of %s failed: %s", what, answer.reason)
                if not isinstance(ev, proto.ShipChunk):
                    verdict.append(answer)
                    return

        with single_errors():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay)
                nursery.start_soon(trio.to_thread.run_sync, sink.run)
                try:
                    while True:
                        ev = await link.receive()
                        await sink.put(ev)
                        progress.update(rx.pos, trio.current_time())
                        shown.update(rx.pos - shown.n)
                        if not isinstance(ev, proto.ShipChunk):
                            break  # ShipEnd (or a stray event, which the receiver refuses) ends the exchange
                finally:
                    sink.stop()
        reply = verdict[0]
        progress.update(rx.pos, trio.current_time())
        shown.close()
        if isinstance(reply, proto.Ack) and reply.code == ShipAck.OK:
            log.info("%s done in %.1fs", progress.line(), progress.now - progress.started)
            return rx.path
        if isinstance(reply, proto.Ack):
            log.warning("ship of %s failed: %s", what, reply.reason)
        return None
    finally:
        if shown is not None:
            shown.close()
        rx.close()


async def _await_reply(link) -> proto.Event:
    """The receiver's one answer after ShipResume: an Ack, or an Error (as an event or the Link's RemoteError)."""
    try:
        return await link.receive()
    except RemoteError as exc:
        return proto.Error(exc.code, exc.reason)


async def ship_range(link, source: RangePlan | str | os.PathLike, start: int | None = None,
                     end: int | None = None, *, label: str = "", board: ProgressBoard | None = None,
                     digest_memo: str | os.PathLike | None = None, chunk: int = CHUNK_BYTES) -> ShipResult:
    """Ship layers [start, end) of the GGUF `source` (or an already made RangePlan) over `link`.

    Resumes from whatever the receiver holds; if a resumed file fails its hash, re-ships once from zero.
    `digest_memo` is a directory where the file's SHA-256 is remembered (see RangePlan.sha256), so a restarted
    coordinator resumes without first re-reading the whole range.
    Raises ShipBusy when another shipper holds the target, ShipFailed when the receiver reports a failure or the
    source cannot be read; a bad source or range raises the planner's RangeGGUFError before anything is sent; Link
    errors propagate.
    """
    if isinstance(source, RangePlan):
        plan = source
    else:
        if start is None or end is None:
            raise ValueError("ship_range needs start and end with a source path")
        plan = await trio.to_thread.run_sync(plan_range_gguf, source, start, end)
    digest = await trio.to_thread.run_sync(plan.sha256, digest_memo)
    board = board if board is not None else _default_board()
    name = f"{label + ' ' if label else ''}layers {plan.start}..{plan.end}"
    t0, sent, attempt = trio.current_time(), 0, 0
    while True:
        attempt += 1
        resumed_at, n, reply = await _ship_once(link, plan, digest, chunk, name, board)
        sent += n
        if isinstance(reply, proto.Ack) and reply.code == ShipAck.OK:
            return ShipResult(plan.fingerprint, plan.start, plan.end, plan.size, resumed_at, sent, attempt,
                              trio.current_time() - t0)
        if isinstance(reply, proto.Ack) and reply.code == ShipAck.HASH_MISMATCH and resumed_at > 0 and attempt == 1:
            log.warning("%s: the resumed partial was corrupt (%s); shipping again from zero", name, reply.reason)
            continue
        reason = reply.reason if isinstance(reply, (proto.Ack, proto.Error)) else type(reply).__name__
        raise ShipFailed(f"{name}: the receiver failed the shipment: {reason}",
                         reply.code if isinstance(reply, proto.Error) else ErrorCode.INTERNAL)


def _take(chunks: Iterator[bytes], n: int) -> list[bytes]:
    return list(itertools.islice(chunks, n))


async def _read_ahead(chunks: Iterator[bytes], out: trio.MemorySendChannel) -> None:
    """Batches of READ_AHEAD chunks into `out` (unbuffered: at most one batch waits while one is being sent), then
    a RangeGGUFError if the source failed; `out` is closed at the end of the file."""
    async with out:
        while True:
            try:
                batch = await trio.to_thread.run_sync(_take, chunks, READ_AHEAD)
            except RangeGGUFError as exc:
                await out.send(exc)
                return
            if not batch:
                return
            await out.send(batch)


async def _ship_once(link, plan: RangePlan, digest: bytes, chunk: int, name: str,
                     board: ProgressBoard) -> tuple[int, int, proto.Event]:
    await link.send(proto.ShipBegin(plan.fingerprint, plan.start, plan.end, plan.size, digest, plan.name))
    first = await _await_reply(link)
    if isinstance(first, proto.Error):
        if first.code == ErrorCode.BUSY:
            raise ShipBusy(f"{name}: {first.reason}")
        raise ShipFailed(f"{name}: the receiver refused the shipment: {first.reason}", first.code)
    if not isinstance(first, proto.ShipResume) or not 0 <= first.offset <= plan.size:
        raise ShipFailed(f"{name}: expected ShipResume within {plan.size} bytes, got {first!r:.100}",
                         ErrorCode.UNEXPECTED)
    offset = pos = first.offset
    now = trio.current_time()
    progress = ShipProgress(name, plan.size, now, offset, offset, now)
    reply: list[proto.Event] = []
    source_error: RangeGGUFError | None = None

    async def watch(sending: trio.CancelScope) -> None:
        reply.append(await _await_reply(link))
        sending.cancel()  # an answer before ShipEnd is a failure: stop sending

    try:
        with single_errors():
            async with trio.open_nursery() as nursery:
                with trio.CancelScope() as sending:
                    nursery.start_soon(watch, sending)
                    with closing(plan.iter_chunks(offset, chunk)) as chunks, single_errors():
                        async with trio.open_nursery() as reading:
                            # Reads run in a thread (a cold disk must not stall the loop), a few chunks per trip so
                            # the hand-off costs little, and one batch ahead of the sends: read in turn with
                            # sending, they left the wire idle for a quarter of a loopback shipment.
                            put, batches = trio.open_memory_channel(0)
                            reading.start_soon(_read_ahead, chunks, put)
                            async for batch in batches:
                                if isinstance(batch, RangeGGUFError):
                                    source_error = batch
                                    break
                                for data in batch:
                                    await link.send(proto.ShipChunk(pos, data))
                                    pos += len(data)
                                    progress.update(pos, trio.current_time())
                                    board.update(progress)
                            reading.cancel_scope.cancel()
                # ShipEnd closes the exchange in every case: the receiver verifies, reports a short file, or stops
                # dropping the chunks that followed its Error.
                await link.send(proto.ShipEnd(digest))
    finally:
        progress.update(pos, trio.current_time())
        board.update(progress, final=True)
    if source_error is not None:
        raise ShipFailed(f"{name}: reading the source failed at byte {pos}: {source_error}")
    return offset, pos - offset, reply[0]
