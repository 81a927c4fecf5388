"""mesh.console: progress bars on and off a terminal, log lines around them, logs held while an answer streams."""
from __future__ import annotations

import io
import logging

import trio

from mesh import console


def test_off_a_terminal_a_bar_prints_plain_lines_without_carriage_returns():
    out = io.StringIO()
    b = console.bar("downloading model.gguf", total=4_000_000, stream=out, tty=False)
    for _ in range(4):
        b.update(1_000_000)        # within PLAIN_EVERY of each other: no line for these
    b.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert len(lines) == 2 and lines[0].startswith("downloading model.gguf:   0%"), lines
    assert lines[1].startswith("downloading model.gguf: 100%") and "4.00M/4.00M" in lines[1], lines


def test_on_a_terminal_a_bar_redraws_in_place():
    out = io.StringIO()
    b = console.bar("shipping layers 0..4", total=100, stream=out, tty=True)
    b.update(100)
    b.close()
    assert "\r" in out.getvalue() and "shipping layers 0..4: 100%" in out.getvalue()


def test_a_bar_that_ends_within_its_delay_prints_nothing():
    out = io.StringIO()
    b = console.bar("prefill of 12 prompt tokens", total=12, unit="tok", stream=out, tty=False, delay=60)
    b.update(12)
    b.close()
    assert out.getvalue() == ""


async def test_an_activity_shows_what_it_waits_for_and_the_seconds_spent():
    out = io.StringIO()
    async with console.activity("loading layers 0..4 of m.gguf", stream=out, tty=False, delay=0):
        await trio.sleep(0)
    assert out.getvalue() == "loading layers 0..4 of m.gguf: 00:00\n"
    quiet = io.StringIO()
    async with console.activity("a quick one", stream=quiet, tty=False):     # default delay: 1 s
        pass
    assert quiet.getvalue() == ""


def test_log_lines_wait_while_an_answer_streams_and_follow_it_in_order():
    err = io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("test.console")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        console.install_log_stream(handler)
        log.info("before")
        with console.answering():
            log.info("first token after 0.42s")
            log.info("peer 2 joined")
            assert err.getvalue() == "before\n"        # nothing lands in the middle of the answer
        assert err.getvalue() == "before\nfirst token after 0.42s\npeer 2 joined\n"
        log.info("after")
        assert err.getvalue().endswith("peer 2 joined\nafter\n")
    finally:
        log.removeHandler(handler)
        console._gate = None
