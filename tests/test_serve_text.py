"""Stop strings on streamed text: whatever way the text is cut into tokens, the client gets exactly the text before
the first stop string, and never a piece of one."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.serve.openai_api import _Text


class _Bytes:
    """A vocabulary where token i is the i-th chunk of a given byte string (UTF-8 characters may be cut anywhere)."""
    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    def token_bytes(self, i: int) -> bytes:
        return self.chunks[i]


def _stream(text: str, cuts: list[int], stops: tuple[str, ...]) -> tuple[list[str], str, bool]:
    data = text.encode()
    edges = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    chunks = [data[a:b] for a, b in zip(edges, edges[1:])]
    t = _Text(_Bytes(chunks), stops)
    pieces = []
    for i in range(len(chunks)):
        pieces.append(t.feed(i))
        if t.stopped:
            break
    pieces.append(t.finish())
    return pieces, "".join(pieces), t.stopped


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab€\n ", max_size=40), st.lists(st.integers(0, 120), max_size=30),
       st.lists(st.text(alphabet="ab€\n ", min_size=1, max_size=4), max_size=3))
def test_the_text_before_the_first_stop_and_no_more(text, cuts, stops):
    stops = tuple(stops)
    pieces, out, stopped = _stream(text, cuts, stops)
    # the text before the stop string that is complete first (ties: the one that starts first), however it is cut
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    assert out == (text[:min(hits)[1]] if hits else text)
    assert stopped == bool(hits)
    shown = ""
    for p in pieces:                 # no prefix the client saw ever ran past the answer
        shown += p
        assert out.startswith(shown)


def test_overlapping_stops_cut_where_the_first_one_completes_whatever_the_tokens():
    # "\n" is complete after "a\n", before "a\na" is: one token or two, the answer is "a" (found by hypothesis)
    for cuts in ([], [2], [1], [1, 2]):
        assert _stream("a\na", cuts, ("\n", "a\na"))[1] == "a"


def test_a_stop_split_across_tokens_is_held_back_then_dropped():
    pieces, out, stopped = _stream("Hello END world", [7, 8, 9, 10], ("END",))
    assert out == "Hello " and stopped and "E" not in "".join(pieces)


def test_text_that_only_looks_like_a_stop_start_is_released():
    pieces, out, stopped = _stream("an ENDing", [4, 5], ("END!",))
    assert out == "an ENDing" and not stopped
