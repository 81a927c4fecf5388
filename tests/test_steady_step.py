"""The steady decode step (mesh/proto/steady.py, Codec.open_whole / seal_plain, Link.fast): a frame opened whole and
read without decoding gives what the decoder gives, a reply written from plaintext is the encoder's frame, and a
Link's `fast` hook sees each whole frame once, consumes it or lets it go the usual way, with flow control intact.
Pure (memory streams, no model); the peer's use of it is tests/test_peer_steady.py."""
from __future__ import annotations

import os

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh.proto as p
from mesh.link import open_link

KEY_A, KEY_B = os.urandom(32), os.urandom(32)


def sealed_pair() -> tuple[p.Codec, p.Codec]:
    a, b = p.Codec(), p.Codec()
    a.seal(KEY_A, KEY_B)
    b.seal(KEY_B, KEY_A)
    return a, b


def plain_of(ev: p.Event) -> bytes:
    return bytes((ev.TYPE,)) + b"".join(p.codec.encode_payload(ev))


def step(group, pos, token, rows: bytes | None, *, slot=3, logits=True, wide=False, sampling=(p.Sampling(),)):
    hidden = None if rows is None else p.Activation("f32", (1, len(rows) // 4), rows)
    return p.BatchStep(group, wide, (p.Column(pos, slot, logits, token),), hidden, sampling)


u32 = st.integers(0, 2**32 - 1)


@settings(max_examples=200, deadline=None)
@given(group=u32, pos=u32, token=u32, group2=u32, pos2=u32, token2=u32, dim=st.sampled_from([0, 1, 4, 576]),
       hidden=st.booleans(), temp=st.sampled_from([0.0, 0.7]), seed=st.integers(0, 2**64 - 1))
def test_a_matching_step_reads_as_the_decoder_reads_it(group, pos, token, group2, pos2, token2, dim, hidden, temp,
                                                       seed):
    sampling = (p.Sampling(temp, 40, 0.9, seed),)
    rows = os.urandom(4 * dim) if hidden else None
    learned = p.SteadyStep(step(group, pos, token, rows, sampling=sampling))
    rows2 = os.urandom(4 * dim) if hidden else None
    nxt = step(group2, pos2, token2, rows2, sampling=sampling)
    raw = plain_of(nxt)
    assert learned.fits(nxt)
    assert learned.match(raw) == (group2, pos2, token2)
    assert raw[learned.rows_at:learned.rows_end] == (rows2 or b"")
    # the reply written from plaintext is the encoder's: a forward with other rows, and the last stage's tokens
    out = os.urandom(4 * 7)
    fwd = p.BatchStep(group2, False, nxt.columns, p.Activation("f32", (1, 7), out), sampling)
    assert learned.forward(raw, p.activation_head("f32", (1, 7)), out) == plain_of(fwd)
    assert p.tokens_reply(p.MsgType.DONE, group2, (token2, 5)) == plain_of(p.Done(group2, (token2, 5)))
    assert p.tokens_reply(p.MsgType.TOKENS, group2, (token2,)) == plain_of(p.Tokens(group2, (token2,)))


@pytest.mark.parametrize("other", [
    step(1, 5, 9, bytes(16), slot=4),                                   # another slot
    step(1, 5, 9, bytes(16), logits=False),
    step(1, 5, 9, bytes(16), wide=True),
    step(1, 5, 9, bytes(16), sampling=(p.Sampling(0.5),)),              # another request's sampling
    step(1, 5, 9, bytes(20)),                                           # another width
    step(1, 5, 9, None),
    p.BatchStep(1, False, (p.Column(5, 3, True, 9), p.Column(6, 3, True, 9)), p.Activation("f32", (2, 4), bytes(32))),
    p.BatchStep(1, False, (p.Column(5, 3, True, 9),), p.Activation("f16", (1, 8), bytes(16))),
    p.BatchStep(1, False, (p.Column(5, 3, True, 9),), p.Activation("f32", (4,), bytes(16))),
])
def test_any_other_shape_does_not_match(other):
    learned = p.SteadyStep(step(1, 5, 9, bytes(16)))
    assert learned.match(plain_of(other)) is None
    if len(other.columns) == 1:
        assert not learned.fits(other)


def test_only_one_column_steps_are_learned():
    with pytest.raises(ValueError):
        p.SteadyStep(p.BatchStep(1, False, (p.Column(5, 3, True, 9), p.Column(6, 3, True, 9))))


def test_open_whole_gives_next_events_events_and_refuses_what_it_refuses():
    a, b = sealed_pair()
    events = [step(7, 10, 3, os.urandom(64)), p.Ping(5), p.Done(7, (3,))]
    for ev in events:
        data = a.send(ev)
        plain = b.open_whole(data)
        assert plain is not None and b.decode_opened(plain) == ev and b.last_size == len(data)
    # what is not exactly one frame with nothing buffered: nothing done, the usual way takes it
    two = a.send(p.Ping(1)) + a.send(p.Ping(2))
    assert b.open_whole(two) is None and b.open_whole(two[:10]) is None
    b.receive_data(two[:10])
    assert b.open_whole(two[10:]) is None
    b.receive_data(two[10:])
    assert [b.next_event(), b.next_event(), b.next_event()] == [p.Ping(1), p.Ping(2), p.NEED_DATA]
    assert p.Codec().open_whole(a.send(p.Ping(3))) is None        # not sealed yet: the plain path decides
    # an altered frame fails the codec as next_event would, and it stays failed
    data = bytearray(a.send(p.Ping(4)))
    data[-1] ^= 1
    with pytest.raises(p.ProtocolError, match="does not open"):
        b.open_whole(bytes(data))
    with pytest.raises(p.ProtocolError):
        b.next_event()


def test_seal_plain_is_the_codecs_frame():
    a, b = sealed_pair()
    ev = step(1, 2, 3, os.urandom(32))
    b.receive_data(a.seal_plain(plain_of(ev)))
    assert b.next_event() == ev
    with pytest.raises(ValueError, match="exceeds max_frame"):
        p.Codec(max_frame=8).seal_plain(b"\x01" + bytes(9))


async def test_a_links_fast_hook_consumes_or_passes_each_whole_frame_with_credit_returned():
    """Every whole BatchStep frame goes to `fast` once; what it consumes is never queued, what it passes arrives by
    `receive` in order; the credit of consumed frames comes back (a sender of many frames beyond the window never
    stalls); other frame types never reach the hook."""
    left, right = trio.testing.memory_stream_pair()
    seen, took = [], []

    def fast(plain) -> bool:
        ev = p.Codec().decode_opened(plain)     # a plain codec decodes an opened payload the same way
        seen.append(ev)
        if ev.group % 2 == 0:
            took.append(ev)
            return True
        return False

    async with trio.open_nursery() as nursery:
        async def server():
            async with open_link(right, token=b"t", role="server", window=4096) as link:
                link.fast, link.fast_type = fast, p.MsgType.BATCH_STEP
                got = []
                while len(got) < 22:
                    got.append(await link.receive())
                results.append(got)
                finished.set()
        results: list = []
        finished = trio.Event()
        nursery.start_soon(server)
        async with open_link(left, token=b"t", role="client", window=4096) as link:
            for g in range(40):
                await link.send(step(g, g, g, bytes(256)))
                await trio.testing.wait_all_tasks_blocked()
                if g == 20:
                    await link.send(p.Done(99, (1,)))
            await link.send(p.Done(100, (2,)))
            with trio.fail_after(10):
                await finished.wait()
    assert [ev.group for ev in took] == list(range(0, 40, 2))
    assert [ev.group for ev in seen] == list(range(40))
    assert [ev.group for ev in results[0]] == [*range(1, 21, 2), 99, *range(21, 40, 2), 100]


@settings(max_examples=100, deadline=None)
@given(group=u32, pos=u32, token=u32, slot=st.sampled_from([0, 3]), logits=st.booleans(),
       temp=st.sampled_from([0.0, 0.7]))
def test_the_coordinators_next_step_is_the_encoders_frame(group, pos, token, slot, logits, temp):
    sampling = (p.Sampling(temp, 0, 1.0, 11),)
    learned = p.SteadyStep(step(1, 2, 3, None, slot=slot, logits=logits, sampling=sampling))
    col = p.Column(pos, slot, logits, token)
    assert learned.plain_for(group, col, sampling) == plain_of(p.BatchStep(group, False, (col,), None, sampling))
    assert learned.plain_for(group, p.Column(pos, slot + 1, logits, token), sampling) is None
    assert learned.plain_for(group, p.Column(pos, slot, not logits, token), sampling) is None
    assert learned.plain_for(group, col, (p.Sampling(0.3),)) is None
    assert learned.plain_for(2**32, col, sampling) is None                     # out of u32: the encoder says so
    assert p.SteadyStep(step(1, 2, 3, bytes(8))).plain_for(group, col, (p.Sampling(),)) is None   # rows: not this
