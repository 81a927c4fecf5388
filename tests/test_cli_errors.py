"""What a user sees when something is wrong: one line that names the thing and the reason, and the right exit code.

Each case runs `python -m mesh` as a subprocess, as a user would. Argument errors exit 2 (argparse) before anything
starts; expected failures exit 1 with one `prog: ...` line; Ctrl-C says goodbye and exits 130.
"""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import threading

import pytest

from tests.mesh_fixtures import ROOT, child_env, free_port, mesh_cmd, write_tiny_chat_model

TOKEN = "cli-tests-fleet-token-0123456789"


def sigint_default() -> None:
    """Ctrl-C as a terminal delivers it. A child of a shell's background job (CI runners, `cmd &`) inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler: the child would never see the test's SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def watchdog(p: subprocess.Popen, seconds: float) -> threading.Timer:
    """Kill p if it still runs after `seconds`, so a test reading its pipes fails instead of hanging."""
    timer = threading.Timer(seconds, p.kill)
    timer.start()
    return timer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=2)


def run(role: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(mesh_cmd(role, *args), cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(p: subprocess.CompletedProcess, prog: str, *words: str) -> str:
    assert "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: "), p.stderr
    for w in words:
        assert w in last, p.stderr
    return last


@pytest.mark.parametrize("role, args, words", [
    ("coord", ["--listen", "127.0.0.1:99999"], ["--listen", "out of range"]),
    ("coord", ["--listen", "nonsense"], ["--listen", "missing port"]),
    ("peer", ["--join", "nonsense", "--token", TOKEN], ["--join", "missing port"]),
    ("peer", ["--join", "host:99999", "--token", TOKEN], ["--join", "out of range"]),
    ("peer", ["--join", "127.0.0.1:9000", "--listen", "0.0.0.0:70000", "--token", TOKEN], ["--listen", "range"]),
    ("peer", ["--join", "127.0.0.1:9000", "--retry-for", "-3", "--token", TOKEN], ["--retry-for"]),
])
def test_bad_arguments_fail_before_anything_starts(role, args, words):
    p = run(role, *args)
    assert p.returncode == 2
    one_line_error(p, f"mesh-{role}", "error:", *words)


@pytest.mark.parametrize("role", ["coord", "peer"])
def test_a_bad_spin_setting_is_one_line_before_anything_starts(role, model):
    args = ["--model", str(model), "--token", TOKEN] + (["--join", "127.0.0.1:9"] if role == "peer" else
                                                       ["--listen", "127.0.0.1:0", "--prompt", "hi"])
    p = subprocess.run(mesh_cmd(role, *args), cwd=ROOT, env=dict(child_env(), MESH_SPIN_US="fast"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    one_line_error(p, f"mesh-{role}", "MESH_SPIN_US='fast'", "microseconds")


def test_a_peer_without_a_token_is_told_where_to_get_one():
    p = run("peer", "--join", "127.0.0.1:9")
    assert p.returncode == 1
    one_line_error(p, "mesh-peer", "no fleet token", "--insecure-open")


def test_insecure_open_and_a_token_contradict():
    p = run("peer", "--join", "127.0.0.1:9", "--insecure-open", "--token", TOKEN)
    assert p.returncode == 1
    one_line_error(p, "mesh-peer", "--insecure-open")


@pytest.mark.parametrize("content", [b"not a gguf at all" * 100, b"GGUF\x03\x00\x00\x00" + bytes(10)])
def test_a_model_that_is_not_a_usable_gguf_is_one_line(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    p = run("peer", "--join", "127.0.0.1:9", "--token", TOKEN, "--model", str(bad))
    assert p.returncode == 1
    one_line_error(p, "mesh-peer", str(bad))
    p = run("coord", "--model", str(bad), "--insecure-open")
    assert p.returncode == 1
    one_line_error(p, "mesh-coord", str(bad))


def test_a_truncated_model_is_one_line(tmp_path, model):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    p = run("peer", "--join", "127.0.0.1:9", "--token", TOKEN, "--model", str(cut))
    assert p.returncode == 1
    one_line_error(p, "mesh-peer", str(cut))


def test_a_port_in_use_is_one_line(model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = run("coord", "--listen", f"127.0.0.1:{port}", "--model", str(model), "--token", TOKEN, "--http",
                "127.0.0.1:0")
    assert p.returncode == 1
    one_line_error(p, "mesh-coord", f"{port}", "cannot listen")


def test_without_a_token_the_coordinator_makes_one_and_prints_the_peer_command(model):
    port = free_port()
    p = run("coord", "--listen", f"127.0.0.1:{port}", "--model", str(model), "--wait", "0.5", "--settle", "0.1",
            "--prompt", "hi")
    assert p.returncode == 1
    m = re.search(r"MESH_TOKEN=(\S+) mesh-peer\n", p.stderr)       # found on the LAN; --join where that fails
    assert m and len(m[1]) >= 32 and f"add --join 127.0.0.1:{port})" in p.stderr, p.stderr
    one_line_error(p, "mesh-coord", "0 of 1 peers joined")


def test_a_short_token_gets_a_warning_and_insecure_open_a_louder_one(model):
    p = run("coord", "--listen", f"127.0.0.1:{free_port()}", "--model", str(model), "--wait", "0.3", "--settle",
            "0.1", "--prompt", "hi", "--token", "SECRET")
    assert "warning: the fleet token is 6 characters" in p.stderr
    p = run("coord", "--listen", f"127.0.0.1:{free_port()}", "--model", str(model), "--wait", "0.3", "--settle",
            "0.1", "--prompt", "hi", "--insecure-open")
    assert "WARNING: --insecure-open" in p.stderr and "MESH_TOKEN=" not in p.stderr


@pytest.mark.parametrize("role", ["coord", "peer"])
def test_ctrl_c_is_a_goodbye_and_exit_130(role, model):
    port = free_port()
    args = (["--listen", f"127.0.0.1:{port}", "--model", str(model), "--token", TOKEN, "--http", "127.0.0.1:0"]
            if role == "coord" else
            ["--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--warmup", "0", "--token", TOKEN])
    ready = "waiting for" if role == "coord" else "unreachable"
    p = subprocess.Popen(mesh_cmd(role, *args), cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=sigint_default)
    dog = watchdog(p, 120)
    try:
        seen = []
        for line in p.stderr:                       # wait until it is up and waiting, then press Ctrl-C
            seen.append(line)
            if ready in line:
                break
        p.send_signal(signal.SIGINT)
        rest = p.stderr.read()
        assert p.wait(timeout=60) == 130, "".join(seen) + rest
    finally:
        dog.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "Traceback" not in rest and rest.strip().splitlines()[-1] == f"mesh-{role}: interrupted; bye"


@pytest.mark.slow
def test_retry_for_gives_up_on_an_unreachable_coordinator():
    p = run("peer", "--join", f"127.0.0.1:{free_port()}", "--listen", "127.0.0.1:0", "--warmup", "0",
            "--retry-for", "1", "--token", TOKEN)
    assert p.returncode == 1
    one_line_error(p, "mesh-peer", "unreachable for", "--retry-for 1")


@pytest.mark.slow
def test_ctrl_c_in_chat_stops_the_answer_and_the_chat_goes_on(model):
    port = free_port()
    peer = subprocess.Popen(mesh_cmd("peer", "--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--warmup",
                                     "0", "--token", TOKEN, "--model", str(model)), cwd=ROOT, env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    coord = subprocess.Popen(mesh_cmd("coord", "--listen", f"127.0.0.1:{port}", "--model", str(model), "--token",
                                      TOKEN, "--settle", "0.2", "--template", "raw", "--max-tokens", "1900",
                                      "--chat"),
                             cwd=ROOT, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=sigint_default)
    dog = watchdog(coord, 240)
    try:
        coord.stdin.write("The quick brown fox jumps over the lazy dog.\n")
        coord.stdin.flush()
        shown = ""
        while len(shown.partition("> ")[2]) < 8:    # the answer streams (its log lines wait): press Ctrl-C
            c = coord.stdout.read(1)
            assert c, shown
            shown += c
        coord.send_signal(signal.SIGINT)
        seen = []
        for line in coord.stderr:
            seen.append(line)
            if "answer stopped" in line:
                break
        assert "answer stopped" in seen[-1], "".join(seen)
        held = "".join(seen)                         # the log line held during the answer came after it
        assert held.index("first token after") > held.index("stage 1: "), held
        coord.stdin.write("\n")                      # the chat is still there: an empty line ends it
        coord.stdin.close()
        rest = coord.stderr.read()
        assert coord.wait(timeout=60) == 0, "".join(seen) + rest
        assert "Traceback" not in "".join(seen) + rest
    finally:
        dog.cancel()
        for p in (peer, coord):
            if p.poll() is None:
                p.kill()
            p.wait()


def test_metadata_of_the_wrong_kind_is_one_line(tmp_path):
    """NaN, inf or a string where the GGUF needs a number: one line naming the file (three peers side by side)."""
    from tests.tiny_gguf import write_tiny_gguf
    bad = [write_tiny_gguf(tmp_path / f"bad{i}.gguf", n_layers=2, extra_kv={"llama.block_count": value})
           for i, value in enumerate([float("nan"), float("inf"), "forty"])]
    procs = [subprocess.Popen(mesh_cmd("peer", "--join", "127.0.0.1:9", "--retry-for", "1", "--token", TOKEN,
                                       "--model", str(path)), cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for path in bad]
    for path, proc in zip(bad, procs):
        out, err = proc.communicate(timeout=120)
        p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        assert p.returncode == 1
        one_line_error(p, "mesh-peer", str(path))


def test_a_peer_gone_mid_shipment_is_one_line(model):
    """A modelless peer that takes the first chunk of its layers and vanishes: mesh-coord --prompt names it in one
    line (it printed an exception-group traceback)."""
    import trio

    from mesh import proto
    from mesh.link import open_link

    port = free_port()
    coord = subprocess.Popen(mesh_cmd("coord", "--listen", f"127.0.0.1:{port}", "--model", str(model), "--token",
                                      TOKEN, "--settle", "0.1", "--wait", "60", "--prompt", "hi"),
                             cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)

    async def fake_peer() -> None:
        with trio.fail_after(60):
            while True:
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    break
                except OSError:
                    await trio.sleep(0.1)
            async with open_link(stream, token=TOKEN.encode(), role="client") as link:
                await link.send(proto.Join(1, "", 1024))
                while True:
                    ev = await link.receive()
                    if isinstance(ev, proto.InfoRequest):
                        await link.send(proto.Info(0, 0, 0, 1024, False, "", "CPU", False))
                    elif isinstance(ev, proto.Load):
                        await link.send(proto.Ack(proto.MsgType.LOAD, int(proto.LoadCode.NEED_WEIGHTS), "ship"))
                    elif isinstance(ev, proto.ShipBegin):
                        await link.send(proto.ShipResume(0))
                    elif isinstance(ev, proto.ShipChunk):
                        await trio.aclose_forcefully(link.stream)     # gone, mid-shipment
                        return
    try:
        try:
            trio.run(fake_peer)
        except Exception:
            pass                                      # our own link notices it was cut: that is the point
        err = coord.stderr.read()
        assert coord.wait(timeout=60) == 1, err
    finally:
        if coord.poll() is None:
            coord.kill()
            coord.wait()
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("mesh-coord: "), err


def test_failures_inside_exception_groups_become_one_line_or_a_goodbye(capsys):
    import trio

    from mesh.cli import _exit_on, _expected_kinds
    from mesh.link import LinkClosed
    kinds = _expected_kinds()
    with pytest.raises(SystemExit) as exc:
        _exit_on("mesh-coord", kinds, BaseExceptionGroup("x", [ExceptionGroup("y", [LinkClosed("peer 2 went\naway")]),
                                                               trio.Cancelled._create()]))
    assert exc.value.code == "mesh-coord: peer 2 went\\naway"
    with pytest.raises(SystemExit) as exc:
        _exit_on("mesh-coord", kinds, ExceptionGroup("x", [trio.TooSlowError()]))
    assert "TooSlowError" in exc.value.code
    with pytest.raises(SystemExit) as exc:
        _exit_on("mesh-peer", kinds, BaseExceptionGroup("x", [KeyboardInterrupt(), LinkClosed("gone")]))
    assert exc.value.code == 130 and "interrupted; bye" in capsys.readouterr().err
    with pytest.raises(ExceptionGroup):               # a bug stays a traceback
        _exit_on("mesh-peer", kinds, ExceptionGroup("x", [ZeroDivisionError()]))
