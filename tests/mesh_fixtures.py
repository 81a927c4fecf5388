"""Fixtures for tests that run whole meshes: a tiny chat model with a real byte-level tokenizer, and process helpers.

The tiny model's weights come from `tests/tiny_gguf.py`; its vocabulary is the 256 byte tokens of GPT-2's byte-level
BPE plus ChatML control tokens, and its chat template is the one in the bundled SmolLM2 file. So a mesh can render a
chat prompt, tokenize it, generate and detokenize with a model that loads in a fraction of a second.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import trio

from engine.stage import Sampling
from engine.tokenizer import Tokenizer
from engine.worker import open_worker
from mesh.link import open_link
from mesh.pipeline import LocalPipeline, generate
from tests.tiny_gguf import byte_chars, write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _smollm2_template() -> str:
    from engine.sources import default_model_path
    reader = gguf.GGUFReader(str(default_model_path()))
    return reader.fields["tokenizer.chat_template"].contents()


def write_tiny_chat_model(path: Path, *, arch: str = "llama", n_layers: int = 6, seed: int = 0, **kw) -> Path:
    """A tiny random model whose tokenizer really works: byte-level tokens, ChatML control tokens, a chat template."""
    merges = ["Ġ t", "h e", "Ġt he"]        # a few merges, so encoding really runs BPE
    tokens = CONTROL + byte_chars() + ["Ġt", "he", "Ġthe"]
    kw.setdefault("context_length", 2048)
    raw = write_tiny_gguf(path.with_suffix(".raw.gguf"), arch=arch, n_layers=n_layers, vocab_size=len(tokens),
                          seed=seed, **kw)
    reader = gguf.GGUFReader(str(raw))
    w = gguf.GGUFWriter(str(path), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key.startswith("tokenizer.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), vtype)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(_smollm2_template())
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw.unlink()
    return path


def link_handler(token: bytes, sessions, expect: type | None = None):
    """A handler for transport.serve_listener: each connection authenticated as a server, its first event checked
    to be an `expect` (if given), then (link, done) sent on `sessions` (a memory channel's send side); the link
    stays open until the test sets `done`. A fake coordinator (expect=proto.Join) or sink."""
    async def handler(stream):
        async with open_link(stream, token=token, role="server") as link:
            if expect is not None:
                assert isinstance(await link.receive(), expect)
            done = trio.Event()
            await sessions.send((link, done))
            await done.wait()
    return handler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mesh_cmd(role: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "mesh", role, *args]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("MESH_TOKEN", None)
    env.update(extra)
    return env


@contextmanager
def processes():
    """Start processes; on exit kill whatever is still running, so a failed test leaves nothing behind."""
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("env", child_env())
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        p = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, **kw)
        procs.append(p)
        return p
    try:
        yield start
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
            for f in (p.stdout, p.stderr):
                if f:
                    f.close()


def run_coord(start, port: int, model: Path, *args: str, timeout: float = 240.0) -> tuple[int, dict | None, str]:
    """Run `mesh coord --json` to completion; return (exit code, parsed answer or None, stderr)."""
    p = start(mesh_cmd("coord", "--listen", f"127.0.0.1:{port}", "--model", str(model), "--json", *args))
    out, err = p.communicate(timeout=timeout)
    answer = json.loads(out.decode().strip().splitlines()[-1]) if p.returncode == 0 and out.strip() else None
    return p.returncode, answer, err.decode(errors="replace")


def unsharded_tokens(model: Path, n_layers: int, prompt: str, max_tokens: int) -> list[int]:
    """Greedy tokens of the unsharded engine: one worker holding every layer, driven by the same generate() as the
    coordinator, so a mesh's output can be compared with it bitwise."""
    async def main() -> list[int]:
        tok = Tokenizer.from_gguf(model)
        async with open_worker() as w:
            await w.load(model, 0, n_layers, warmup=0)
            result = await generate(LocalPipeline(w), tok.encode(prompt), max_tokens=max_tokens, sampling=Sampling(),
                                    eos_ids=tok.eos_ids)
        return result.tokens
    return trio.run(main)
