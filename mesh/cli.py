"""The console scripts: `mesh-coord` and `mesh-peer`. Flags named in the README are a contract: keep their names."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import trio

TOKEN_ENV = "MESH_TOKEN"
API_KEY_ENV = "MESH_API_KEY"
DEFAULT_HTTP = "127.0.0.1:8080"
SHORT_TOKEN = 16             # a shorter fleet token gets a warning: it guards every link's keys
RETRY_FOREVER = None


def _expected_kinds() -> tuple[type, ...]:
    """Failures a user can cause or meet (a model, an address, a peer, a token): one line, not a traceback."""
    from engine.errors import EngineError
    from engine.gguf_range import RangeGGUFError
    from mesh.errors import MeshError
    from mesh.link import LinkError
    from mesh.proto import ProtoError
    from transport import TransportError
    return (MeshError, EngineError, RangeGGUFError, LinkError, ProtoError, TransportError, OSError, trio.TooSlowError)


def _exit_on(prog: str, kinds: tuple[type, ...], exc: BaseException) -> None:
    """Turn an expected failure (possibly wrapped in trio's exception groups) into one line and exit 1; Ctrl-C
    anywhere in the groups is a goodbye and exit 130."""
    from mesh.errors import leaf_errors
    from mesh.logsafe import clean
    leaves = [e for e in leaf_errors(exc) if not isinstance(e, trio.Cancelled)]
    if any(isinstance(e, KeyboardInterrupt) for e in leaves):
        _goodbye(prog)
    expected = [e for e in leaves if isinstance(e, kinds)]
    if expected and len(expected) == len(leaves):
        first = expected[0]
        sys.exit(f"{prog}: {clean(first, 1000) or type(first).__name__}"
                 + (" (a step took longer than its bound)" if isinstance(first, trio.TooSlowError) else ""))
    raise exc


def _goodbye(prog: str) -> None:
    print(f"\n{prog}: interrupted; bye", file=sys.stderr, flush=True)
    sys.exit(130)


def _run(prog: str, main, *args) -> None:
    """trio.run with the CLI's exits: 130 on Ctrl-C, one line and 1 on an expected failure, a traceback otherwise."""
    try:
        trio.run(main, *args)
    except KeyboardInterrupt:
        _goodbye(prog)
    except SystemExit:
        raise
    except BaseException as exc:
        _exit_on(prog, _expected_kinds(), exc)


def _addr(flag: str, *, listen: bool = False):
    """An argparse type: a dial address (HOST:PORT or ws://...), or with `listen` a bindable HOST:PORT, checked when
    the arguments are parsed, so a bad one fails at once instead of being retried or bound somewhere else."""
    def parse(text: str) -> str:
        from transport import AddressError, parse_addr
        try:
            addr = parse_addr(text)
        except AddressError as exc:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: {exc.reason}") from None
        if listen and addr.scheme != "tcp":
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: listen on HOST:PORT (WebSocket clients are served "
                                             f"on the same port)")
        if not listen and addr.port == 0:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: port 0 cannot be dialed")
        return text
    return parse


def _positive(flag: str, *, zero: bool = False):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < (0 if zero else 1):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected a whole number >= {0 if zero else 1}")
        return value
    return parse


def _loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--retry-for {text!r}: expected a number of seconds > 0")
    return value


def _layers(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {text!r}: expected START:END, e.g. 0:10") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"--layers {text!r}: need 0 <= START < END")
    return a, b


def _hops(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--webrtc-hops {text!r}: expected hop numbers like 1,2") from None


def _name(text: str) -> str:
    from mesh.registry import name_problem
    if not text or (why := name_problem(text)) is not None:
        raise argparse.ArgumentTypeError(f"--name {text!r}: {why or 'must not be empty'}")
    return text


def _default_name() -> str:
    """The hostname's first label, made a valid name (a hostname can hold anything on some systems)."""
    import re
    import socket
    from mesh.registry import MAX_NAME
    host = socket.gethostname().split(".")[0]
    return re.sub(r"[^\w.@+-]", "_", host)[:MAX_NAME] or "peer"


def _token(prog: str, args) -> bytes | None:
    """The fleet token from --token or $MESH_TOKEN; None only with --insecure-open. Problems are caught here, before
    anything starts: both given, neither given (mesh-coord then makes one), a short one."""
    tok = args.token if args.token is not None else os.environ.get(TOKEN_ENV)
    if args.insecure_open:
        if tok:
            sys.exit(f"{prog}: --insecure-open runs without a fleet token, but one was given "
                     f"({'--token' if args.token is not None else '$' + TOKEN_ENV}); drop one of them")
        print(f"{prog}: WARNING: --insecure-open: no fleet token. Anyone who can reach this fleet's ports can join "
              f"it, read the prompts and answers, and feed tokens into them.", file=sys.stderr, flush=True)
        return None
    if not tok:
        return None
    if len(tok) < SHORT_TOKEN:
        print(f"{prog}: warning: the fleet token is {len(tok)} characters; use at least {SHORT_TOKEN} random ones "
              f"(mesh-coord without --token makes one)", file=sys.stderr, flush=True)
    return tok.encode()


def _resolve_model(spec: str) -> Path:
    """resolve_source with a progress bar for a download (hf://, https://); a local file shows nothing."""
    from engine.sources import resolve_source
    from mesh.console import bar
    shown = None

    def on_progress(done: int, total: int | None) -> None:
        nonlocal shown
        if shown is None:
            shown = bar(f"downloading {spec.rsplit('/', 1)[-1]}", total=total)
        shown.total = total
        shown.update(done - shown.n)
    try:
        return Path(resolve_source(spec, on_progress=on_progress))
    finally:
        if shown is not None:
            shown.close()


def _check_model(prog: str, path: Path) -> None:
    """Read the model's metadata before anything starts, so a file that is not a usable GGUF is one line."""
    from engine.gguf_meta import read_model_meta
    try:
        read_model_meta(path)
    except _expected_kinds() as exc:
        sys.exit(f"{prog}: model {path}: {exc}")
    except (ValueError, TypeError, OverflowError, KeyError, IndexError) as exc:   # metadata of the wrong kind
        sys.exit(f"{prog}: model {path}: not a usable GGUF: {type(exc).__name__}: {exc}")


def _ice(prog: str, args):
    from signaling import IceConfig, SignalingError
    try:
        return IceConfig.from_flags(args.stun, args.turn, args.turn_user, args.turn_pass)
    except (SignalingError, ValueError) as exc:
        sys.exit(f"{prog}: {exc}")


def _generated_token(listen: str) -> bytes:
    """mesh-coord without a token: make a strong one and tell the user how to start peers with it (as Jupyter
    prints its URL with a token). 24 random bytes: no offline search will find it."""
    import secrets
    import socket
    tok = secrets.token_urlsafe(24)
    host, _, port = listen.rpartition(":")
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    print(f"mesh-coord: no --token given; this fleet's token is {tok}\n"
          f"mesh-coord: start each peer with:\n"
          f"    {TOKEN_ENV}={tok} mesh-peer\n"
          f"mesh-coord: (it finds this coordinator on the local network; where multicast does not reach, add "
          f"--join {host}:{port})", file=sys.stderr, flush=True)
    return tok.encode()


def _logging(verbose: bool, who: str = "") -> None:
    """`who`: the peer's name, put in every log line so that logs of several peers gathered in one place still
    say which peer each line is about."""
    from mesh.logsafe import install
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {who.replace('%', '%%') + ' ' if who else ''}%(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from mesh.console import install_log_stream
    for handler in logging.getLogger().handlers:    # network text escaped, one line a record, repeats limited
        install(handler)
        if isinstance(handler, logging.StreamHandler):
            install_log_stream(handler)             # printed around progress bars, held while an answer streams


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", help=f"fleet token (default: ${TOKEN_ENV}); every connection authenticates with it "
                                   f"and is encrypted with keys derived from it")
    p.add_argument("--insecure-open", action="store_true",
                   help="run an open fleet with no token: anyone who can reach it may join (encrypted against "
                        "eavesdroppers only)")
    p.add_argument("--device", help="tinygrad device, e.g. CPU, CUDA (default: tinygrad's choice, with fallbacks)")
    p.add_argument("--stun", action="append", default=[], help="STUN server URL for WebRTC hops (none by default)")
    p.add_argument("--turn", action="append", default=[],
                   help="TURN server as turn:HOST:PORT?transport=udp with --turn-user/--turn-pass")
    p.add_argument("--turn-user", default="")
    p.add_argument("--turn-pass", default="")
    p.add_argument("--discovery-port", type=int, default=9000, metavar="PORT",
                   help="UDP port of LAN discovery (default 9000; the coordinator and its peers must agree)")
    p.add_argument("-v", "--verbose", action="store_true")


# ---- mesh-coord ----------------------------------------------------------------------------------------------
def coord_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mesh-coord", description="Coordinate a mesh of peers serving one model.")
    p.add_argument("--listen", default="0.0.0.0:9000", type=_addr("--listen", listen=True),
                   help="registry address peers join (default 0.0.0.0:9000)")
    p.add_argument("--model", help="GGUF path or hf:// source (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--min-peers", type=int, default=1, help="wait for this many peers before serving")
    p.add_argument("--settle", type=float, default=2.0, help="seconds of quiet after --min-peers to absorb stragglers")
    p.add_argument("--wait", type=float, default=300.0, help="give up if --min-peers have not joined by then")
    p.add_argument("--chain", choices=("p2p", "hub"), default="p2p")
    p.add_argument("--layers", type=_layers, help="own the first layers locally, as 0:K (default: headless)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--prompt", help="answer this once, print the completion to stdout, exit")
    mode.add_argument("--chat", action="store_true", help="chat on this terminal (stdin) instead of serving HTTP")
    p.add_argument("--http", default=DEFAULT_HTTP, type=_addr("--http", listen=True),
                   help=f"serve the OpenAI-compatible API and the web page here (default {DEFAULT_HTTP}; used "
                        f"without --prompt/--chat). Any address but loopback needs --api-key")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require 'Authorization: Bearer KEY' on every HTTP request (default: ${API_KEY_ENV})")
    p.add_argument("--max-seqs", type=_positive("--max-seqs"), default=4,
                   help="sequences answered at once (KV slots); more requests wait in the queue (default 4)")
    p.add_argument("--max-queue", type=_positive("--max-queue", zero=True), default=64,
                   help="requests that may wait for a slot; past that the answer is 429 with Retry-After (default 64)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--template", choices=("auto", "raw"), default="auto",
                   help="auto: the GGUF's chat template; raw: send the prompt text as is")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--auto-webrtc", action="store_true", help="fall back to WebRTC for hops a direct dial cannot make")
    p.add_argument("--webrtc-hops", type=_hops, default=(), help="force these hops (1 = peer 1 -> peer 2) onto WebRTC")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="compile the decode step of 1..N sequences and the prefill chunks at load, before reporting "
                        "ready (default 1: a session decodes one; 0: compile each step shape when first used)")
    p.add_argument("--no-discovery", action="store_true",
                   help="do not answer peers that look for this fleet's coordinator on the local network")
    p.add_argument("--json", action="store_true",
                   help="with --prompt: print one JSON object (text, token ids, timings) instead of streaming text")
    p.add_argument("--placement", choices=("speed", "memory"), default="speed",
                   help="speed (default): layers go where the predicted time per token is least, by each peer's "
                        "measured speed and link, within its memory; a peer that would slow the chain is left out. "
                        "memory: split by reported memory alone (peers' --memory-gb and --layers apply to both)")
    _common(p)
    return p


def coord_main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["status"]:
        try:
            return status_main(argv[1:])
        except BrokenPipeError:     # `mesh-coord status | head`: the reader left; no traceback for that
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
    parser = coord_parser()
    args = parser.parse_args(argv)
    if args.prompt is None and not args.chat:
        from transport import parse_addr
        host = parse_addr(args.http).host
        if not args.api_key and not _loopback(host):
            parser.error(f"--http {args.http}: serving beyond this machine needs an API key, or anyone who can reach "
                         f"the port can use the model: pass --api-key KEY or set ${API_KEY_ENV} (clients then send "
                         f"'Authorization: Bearer KEY'), or serve on 127.0.0.1")
    _logging(args.verbose)
    from engine.sources import default_model_path
    from mesh.coordinator import CoordConfig

    try:
        model = _resolve_model(args.model) if args.model else default_model_path()
    except Exception as exc:
        sys.exit(f"mesh-coord: model {args.model or '(default)'}: {exc}")
    _check_model("mesh-coord", Path(model))
    from mesh.link import spin_from_env
    try:
        spin_from_env()     # a bad MESH_SPIN_US is said here, before anything listens
    except ValueError as exc:
        sys.exit(f"mesh-coord: {exc}")
    if args.layers and args.layers[0] != 0:
        sys.exit("mesh-coord: --layers must start at 0 (the coordinator holds the first layers)")
    ice = _ice("mesh-coord", args)
    token = _token("mesh-coord", args)
    if token is None and not args.insecure_open:
        token = _generated_token(args.listen)
    cfg = CoordConfig(model=Path(model), listen=args.listen, token=token, min_peers=args.min_peers,
                      settle=args.settle, wait=args.wait, chain=args.chain, layers=args.layers, device=args.device,
                      auto_webrtc=args.auto_webrtc, webrtc_hops=args.webrtc_hops, max_context=args.max_context,
                      warmup=args.warmup, ice=ice, n_slots=args.max_seqs,
                      stage_warmup=-1 if args.prompt is None and not args.chat else 0,
                      placement=args.placement)
    _run("mesh-coord", _run_coord, cfg, args)


async def _run_coord(cfg, args) -> None:
    from common.values import Sampling
    from mesh.coordinator import Coordinator
    from mesh.session import open_session

    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as exc:
        sys.exit(f"mesh-coord: {exc}")
    coord = Coordinator(cfg)
    async with trio.open_nursery() as nursery:
        port = await coord.serve_registry(nursery)
        if not args.no_discovery:
            from mesh.discovery import Responder
            host = cfg.listen.rpartition(":")[0].strip("[]")
            nursery.start_soon(Responder(cfg.token, "" if host in ("0.0.0.0", "::") else host, port,
                                         _default_name(), port=args.discovery_port).serve)   # scrypt: not in the way
        logging.getLogger("mesh.coord").info("registry listening on %s (port %d); waiting for %d peer(s)",
                                             cfg.listen, port, cfg.min_peers)
        if args.prompt is not None:
            async with open_session(coord) as session:
                await _answer_once(coord, session.pipe, args, sampling)
        elif args.chat:
            await _chat(coord, args, sampling)
        else:
            await _serve(coord, nursery, args)
        nursery.cancel_scope.cancel()


async def _serve(coord, nursery, args) -> None:
    """The service: HTTP on --http, sessions formed and re-formed as peers come and go, until Ctrl-C."""
    from mesh.serve.app import build_app
    from mesh.serve.service import Service, serve_http
    from transport import parse_addr

    service = Service(coord, max_seqs=args.max_seqs, max_queue=args.max_queue, api_key=args.api_key,
                      template=args.template)
    addr = parse_addr(args.http)
    port = await nursery.start(serve_http, build_app(service), addr.host, addr.port)
    host = f"[{addr.host}]" if ":" in addr.host else addr.host
    logging.getLogger("mesh.coord").info(
        "serving the OpenAI-compatible API on http://%s:%d/v1 (model %r%s)", host, port, service.model_id,
        ", API key required" if service.api_key else "")
    await service.run()


async def _answer_once(coord, pipe, args, sampling) -> None:
    ids = coord.encode(args.prompt, template=args.template)
    t0 = trio.current_time()
    first: list[float] = []
    stamps: list[float] = []

    def on_token(_tok: int) -> None:
        first or first.append(trio.current_time())
        stamps.append(time.perf_counter())
    out = await coord.answer(pipe, ids, max_tokens=args.max_tokens, sampling=sampling,
                             stream_to=None if args.json else sys.stdout, on_token=on_token, note_rate=False)
    t1 = trio.current_time()
    if args.json:
        import json
        from engine.chat import strip_stop_markers, stop_markers
        text = strip_stop_markers(coord.tokenizer.decode(out), stop_markers(coord.tokenizer))
        decode_s = t1 - first[0]
        print(json.dumps({"text": text, "tokens": out, "prompt_tokens": len(ids), "first_token_s": round(first[0] - t0, 4),
                          "decode_s": round(decode_s, 4),
                          "decode_tok_s": round((len(out) - 1) / decode_s, 3) if len(out) > 1 and decode_s > 0 else None}))
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    coord.note_decode_rate(stamps)


class _Shown:
    """Standard output for one answer. It counts the characters that reached the user, so that an answer begun
    again on a re-formed mesh prints only what the user has not seen yet: generation is deterministic (greedy, or
    sampled from Philox(seed, position)) and any split gives bitwise the same tokens, so the text repeats exactly."""

    def __init__(self, out, skip: int) -> None:
        self.out, self.skip, self.written = out, skip, 0

    def write(self, text: str) -> None:
        self.written += len(text)
        cut = min(self.skip, len(text))
        self.skip -= cut
        if text[cut:]:
            self.out.write(text[cut:])

    def flush(self) -> None:
        self.out.flush()


CHAT_RETRIES = 3     # a turn is tried this many times more on a re-formed mesh before the chat gives up
REJOIN_SECONDS = 15  # how long a re-form waits for the survivors of a lost session to re-join


async def _chat(coord, args, sampling) -> None:
    """Interactive chat: each turn re-renders the conversation and prefills only what the cache does not hold.

    A stage lost mid-turn does not end the chat: the session closes (the surviving peers re-join), the mesh
    re-forms from whoever is in the pool, re-planning the layers, and the turn is answered again from the start of
    the conversation. The user sees a pause, then the rest of the answer."""
    from mesh.console import answering
    from mesh.errors import SessionError
    from mesh.session import open_session

    history: list[dict] = []
    line: str | None = None       # the turn being answered; kept across a re-form
    shown = 0                     # characters of that turn's answer already on the user's screen
    retries = 0
    lost: list = []               # the members of a session that lost a stage (or whose answer was stopped)
    rejoin = 0                    # how many of them must be back before the next fleet forms
    min_peers = None              # the first fleet waits for --min-peers; a re-form takes whoever is pooled
    print("mesh chat: type a message, an empty line or Ctrl-D ends; Ctrl-C stops an answer.", file=sys.stderr,
          flush=True)
    while True:
        if lost:
            with trio.move_on_after(REJOIN_SECONDS):       # then whoever is pooled forms the next fleet
                await coord.registry.wait_rejoined(lost, rejoin)
            min_peers = 1
        async with open_session(coord, min_peers=min_peers) as session:
            fleet, pipe = session.fleet, session.pipe
            held: list[int] = []      # token ids whose KV the stages hold, in order: nothing on a new fleet
            while True:
                if line is None:
                    sys.stdout.write("> ")
                    sys.stdout.flush()
                    line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                    if not line.strip():
                        return
                    line, shown, retries = line.rstrip("\n"), 0, 0
                ids = coord.encode(line, template=args.template, history=tuple(history))
                common = 0
                for a, b in zip(held, ids):
                    if a != b:
                        break
                    common += 1
                screen = _Shown(sys.stdout, skip=shown)
                got: list[int] = []
                try:
                    with answering():     # log lines wait until the answer is whole
                        out = await _stoppable(coord.answer(pipe, ids, max_tokens=args.max_tokens,
                                                            sampling=sampling, resume_from=common, stream_to=screen,
                                                            on_token=got.append))
                except _Stopped:
                    # Ctrl-C stops this answer only. Steps may still be in flight down the chain, so the session
                    # closes and the fleet re-forms (the peers keep their layers); the conversation goes on.
                    print("\nmesh chat: answer stopped", file=sys.stderr, flush=True)
                    history += [{"role": "user", "content": line},
                                {"role": "assistant", "content": coord.tokenizer.decode(
                                    [t for t in got if t not in coord.tokenizer.eos_ids])}]
                    line, lost, rejoin = None, fleet.members, len(fleet.members)
                    break
                except SessionError as exc:
                    shown = max(shown, screen.written)
                    retries += 1
                    if retries > CHAT_RETRIES:
                        raise
                    print(f"\nmesh chat: {exc}; re-forming the mesh from the peers that are left "
                          f"(attempt {retries} of {CHAT_RETRIES})", file=sys.stderr, flush=True)
                    lost, rejoin = fleet.members, len(fleet.members) - 1
                    break                 # leaving the session sends every surviving peer back to re-join
                sys.stdout.write("\n")
                held = ids + out[:-1]     # the last token was generated but never fed back
                history += [{"role": "user", "content": line},
                            {"role": "assistant", "content": coord.tokenizer.decode(
                                [t for t in out if t not in coord.tokenizer.eos_ids])}]
                line = None


class _Stopped(Exception):
    """Ctrl-C during a chat answer."""


async def _stoppable(answer):
    """Run one answer; Ctrl-C meanwhile cancels it and raises _Stopped instead of ending the program (at the prompt,
    Ctrl-C keeps its usual meaning: goodbye, exit 130)."""
    import signal
    result: list = []
    from mesh.errors import single_errors
    with trio.open_signal_receiver(signal.SIGINT) as interrupts, single_errors():
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                async for _ in interrupts:
                    nursery.cancel_scope.cancel()
                    return

            async def run() -> None:
                result.append(await answer)
                nursery.cancel_scope.cancel()
            nursery.start_soon(watch)
            nursery.start_soon(run)
    if not result:
        raise _Stopped()
    return result[0]


# ---- mesh-coord status ----------------------------------------------------------------------------------------

def status_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mesh-coord status",
                                description="Show a serving coordinator's mesh: peers, hops, per-stage speed, "
                                            "sequences (GET /v1/mesh).")
    p.add_argument("--http", default="127.0.0.1:8080", metavar="HOST:PORT",
                   help="where mesh-coord serves HTTP (default 127.0.0.1:8080), or a http(s):// URL")
    p.add_argument("--api-key", help=f"the server's API key (default: ${API_KEY_ENV})")
    p.add_argument("--json", action="store_true", help="print the status JSON as the server sent it")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                   help="print it again every SECONDS until Ctrl-C (with --json: one object a line)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="give up after (default 10)")
    return p


def status_main(argv: list[str]) -> None:
    """One look at the mesh. Rates are measured between two readings, so when the server has none recent yet, ask
    again a second later (the server keeps the first)."""
    import json
    from mesh.serve.status import format_status
    args = status_parser().parse_args(argv)
    base = args.http if "://" in args.http else f"http://{args.http}"
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    st = _get_status(base, key, args.timeout)
    if st.get("state") == "serving" and any(s.get("tok_per_s") is None and not s.get("local")
                                            for s in st.get("stages", [])):
        time.sleep(1.0)
        st = _get_status(base, key, args.timeout)
    print(json.dumps(st, indent=None if args.watch else 2) if args.json else format_status(st), flush=True)
    while args.watch:
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            sys.exit(130)
        st = _get_status(base, key, args.timeout)
        print(json.dumps(st) if args.json else f"\n{time.strftime('%H:%M:%S')}\n{format_status(st)}", flush=True)


def _get_status(base: str, key: str | None, timeout: float) -> dict:
    import json
    import urllib.error
    import urllib.request
    url = base.rstrip("/") + "/v1/mesh"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # the coordinator is near: no proxy
    try:
        with opener.open(req, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            why = json.loads(exc.read())["error"]["message"]
        except Exception:
            why = exc.reason
        hint = f" (pass --api-key or set ${API_KEY_ENV})" if exc.code == 401 and not key else ""
        sys.exit(f"mesh-coord status: {url}: {exc.code} {why}{hint}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = getattr(exc, "reason", exc)
        sys.exit(f"mesh-coord status: cannot reach {url}: {why} (is mesh-coord serving there? see --http)")


# ---- mesh-peer -----------------------------------------------------------------------------------------------
def peer_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mesh-peer", description="Lend this machine's layers to a mesh.")
    p.add_argument("--join", type=_addr("--join"),
                   help="the coordinator's registry, HOST:PORT or ws://HOST:PORT (default: find a coordinator of "
                        "this fleet on the local network)")
    p.add_argument("--name", type=_name, default=None,
                   help="how the fleet names this peer in its messages (default: this machine's hostname)")
    p.add_argument("--no-show-text", dest="show_text", action="store_false",
                   help="do not print the conversation this peer serves (the [donor] lines show it by default)")
    p.add_argument("--retry-for", type=_seconds, default=RETRY_FOREVER, metavar="SECONDS",
                   help="give up (exit 1) when the coordinator could not be reached for this long (default: keep "
                        "trying; a peer re-joins after every session)")
    p.add_argument("--listen", default="0.0.0.0:0", type=_addr("--listen", listen=True),
                   help="where predecessor peers dial this one (default: any port)")
    p.add_argument("--advertise", type=_addr("--advertise"),
                   help="HOST:PORT (or ws://...) predecessors should dial, if not our source address")
    p.add_argument("--model", help="a local GGUF; without one the peer waits for the coordinator to ship its layers")
    p.add_argument("--layers", type=_layers, help="pin this peer to layers A:B")
    p.add_argument("--memory-gb", type=float, help="planning hint: memory this peer offers (default: free memory)")
    p.add_argument("--cache-dir", type=Path, help="where shipped layers are kept (default: ~/.cache/mesh)")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="compile the decode step of 1..N sequences and the prefill chunks at load, before reporting "
                        "ready (default 1: a session decodes one; 0: compile each step shape when first used)")
    _common(p)
    return p


def peer_main(argv: list[str] | None = None) -> None:
    args = peer_parser().parse_args(argv)
    args.name = args.name or _default_name()
    _logging(args.verbose, args.name)
    from mesh.peer import Peer, PeerConfig, memory_hint_mb

    if args.layers and not args.model:
        sys.exit("mesh-peer: --layers needs --model (a pinned range must be loadable locally)")
    token = _token("mesh-peer", args)
    if token is None and not args.insecure_open:
        sys.exit(f"mesh-peer: no fleet token: pass --token (or set ${TOKEN_ENV}) as mesh-coord printed it, or "
                 f"--insecure-open to join an open fleet")
    model = None
    if args.model:
        try:
            model = _resolve_model(args.model)
        except Exception as exc:
            sys.exit(f"mesh-peer: model {args.model}: {exc}")
    cfg = PeerConfig(join=args.join, token=token, name=args.name, show_text=args.show_text, listen=args.listen,
                     advertise=args.advertise, model=model, layers=args.layers,
                     memory_mb=memory_hint_mb(args.memory_gb, args.device), cache_dir=args.cache_dir, device=args.device,
                     max_context=args.max_context, warmup=args.warmup, retry_for=args.retry_for,
                     discovery_port=args.discovery_port, ice=_ice("mesh-peer", args),
                     stage_in_peer="auto")      # a process of its own: its stage runs in it (engine.local_stage)
    if model is not None:
        _check_model("mesh-peer", model)
    from engine.local_stage import stage_in_process
    from mesh.link import spin_from_env
    try:
        stage_in_process()  # a bad MESH_STAGE_IN_PEER (or MESH_SPIN_US) is said here, not after the peer joined
        spin_from_env()
    except ValueError as exc:
        sys.exit(f"mesh-peer: {exc}")
    _run("mesh-peer", Peer(cfg).run)
