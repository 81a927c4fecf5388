"""The scheduler: many sequences through one pipeline at once, each one's tokens bitwise those of running it alone.

A tiny random model in this process (the engine's Stage behind LocalPipeline) for the unsharded cases, and a real
3-peer chain (in-process peers, each with its worker process, the coordinator's p2p wiring) for the chain case.
Arrivals are tied to other streams' tokens, not to the clock, so every run interleaves the same way.
"""
from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager

import numpy as np
import pytest
import trio

from common.values import Column, Sampling
from engine.stage import Stage
from mesh import proto
from mesh.coordinator import CoordConfig, Coordinator
from mesh.peer import Peer, PeerConfig
from mesh.pipeline import LocalPipeline, Pipeline
from mesh.scheduler import QueueFull, Request, Scheduler, SchedulerStopped, _Core, _Seq
from tests.mesh_fixtures import write_tiny_chat_model

N_LAYERS = 3
N_SLOTS = 8            # 8 sequences, a slot each
CONTEXT = 256
TOKEN = b"scheduler-test-token"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny.gguf", n_layers=N_LAYERS)


class InProcess:
    """A Stage as the LocalStage a pipeline drives (the worker client's methods, without the process)."""

    def __init__(self, stage: Stage):
        self.stage = stage
        self.zeroed: list[int] = []
        self.tables: list[tuple[int, tuple[int, ...]]] = []

    async def step(self, cols, hidden, sampling):
        await trio.lowlevel.checkpoint()
        return self.stage.step(cols, hidden, sampling)

    async def zero_slot(self, slot):
        self.zeroed.append(slot)
        self.stage.zero_slot(slot)

    async def rollback(self, slot, pos):
        self.stage.rollback(slot, pos)

    async def block_table(self, slot, blocks):
        self.tables.append((slot, tuple(blocks)))
        self.stage.block_table(slot, blocks)

    async def reset(self):
        self.stage.reset()


@pytest.fixture(scope="module")
def stage(model):
    return Stage.load(model, 0, N_LAYERS, n_slots=N_SLOTS, max_context=CONTEXT)


@pytest.fixture
def local(stage):
    stage.reset()
    return InProcess(stage)


def streams() -> list[Request]:
    """8 requests: prompt lengths across the prefill chunk's edges (1, 15, 16, 17, 40 ...), different max_tokens."""
    rng = np.random.default_rng(7)
    lengths = [5, 17, 40, 1, 33, 16, 64, 9]
    max_tokens = [30, 22, 26, 28, 3, 18, 14, 25]
    return [Request(tuple(int(t) for t in rng.integers(3, 250, n)), m, Sampling(), frozenset())
            for n, m in zip(lengths, max_tokens)]


async def run_alone(pipe: Pipeline, req: Request, **kw) -> list[int]:
    sched = Scheduler(pipe, n_slots=N_SLOTS, max_context=CONTEXT, **kw)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        async with sched.open(req) as g:
            out = [t async for t in g]
        nursery.cancel_scope.cancel()
    return out


async def run_together(pipe: Pipeline, reqs: list[Request], **kw) -> tuple[list[list[int]], int]:
    """Stream i arrives when stream i-1 has emitted its first token (stream 0 at once); returns the outputs and the
    most sequences seen active at once."""
    sched = Scheduler(pipe, n_slots=N_SLOTS, max_context=CONTEXT, **kw)
    outs: list[list[int]] = [[] for _ in reqs]
    arrived = [trio.Event() for _ in reqs]
    peak = [0]

    async def consume(i: int) -> None:
        if i:
            await arrived[i - 1].wait()
        async with sched.open(reqs[i]) as g:
            async for tok in g:
                outs[i].append(tok)
                peak[0] = max(peak[0], sched.stats().active)
                if len(outs[i]) == 1:
                    arrived[i].set()
        arrived[i].set()
        assert g.finish_reason == "length" and g.completion_tokens == len(outs[i]) == reqs[i].max_tokens

    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        async with trio.open_nursery() as clients:
            for i in range(len(reqs)):
                clients.start_soon(consume, i)
        st = sched.stats()
        assert (st.active, st.queued, st.in_flight) == (0, 0, 0)
        nursery.cancel_scope.cancel()
    return outs, peak[0]


async def test_eight_streams_unsharded_equal_each_stream_alone(local):
    pipe = LocalPipeline(local)
    reqs = streams()
    together, peak = await run_together(pipe, reqs)
    # they really shared steps: 5-6 of the 8 at once. Each arrival waits for the previous stream's first token,
    # which reaches its consumer once the next step is on its way (the one-task driver), so each arrival joins a
    # step later than the scheduler could take it; 7 when consumers ran before the next step was formed
    assert peak >= 5
    for i, req in enumerate(reqs):
        assert together[i] == await run_alone(pipe, req), f"stream {i}"
    assert local.stage._lengths[:N_SLOTS] == [0] * N_SLOTS   # every slot zeroed after use


def sampled(reqs: list[Request]) -> list[Request]:
    """Every other stream samples, each with its own seed; the rest stay greedy."""
    return [Request(r.prompt_ids, r.max_tokens, Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=100 + i)
                    if i % 2 else Sampling(), frozenset()) for i, r in enumerate(reqs)]


async def test_per_sequence_sampling_and_seeds_in_one_batch(local):
    pipe = LocalPipeline(local)
    reqs = sampled(streams())
    together, _ = await run_together(pipe, reqs)
    for i, req in enumerate(reqs):
        assert together[i] == await run_alone(pipe, req), f"stream {i}"
    assert together[1] != await run_alone(pipe, Request(reqs[1].prompt_ids, reqs[1].max_tokens,
                                                        Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=5)))


async def test_a_stop_id_ends_the_stream_and_is_not_emitted(local):
    pipe = LocalPipeline(local)
    req = streams()[2]
    full = await run_alone(pipe, req)
    stop = full[4]
    cut = full[:full.index(stop)]
    sched = Scheduler(pipe, n_slots=N_SLOTS, max_context=CONTEXT)
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        async with sched.open(Request(req.prompt_ids, req.max_tokens, Sampling(), frozenset({stop}))) as g:
            assert [t async for t in g] == cut
        assert g.finish_reason == "stop" and g.completion_tokens == len(cut) and g.prompt_tokens == 40
        nursery.cancel_scope.cancel()


async def test_a_hundred_consumers_that_leave_mid_stream_hold_no_slot(local):
    pipe = LocalPipeline(local)
    sched = Scheduler(pipe, n_slots=N_SLOTS, max_context=CONTEXT, max_seqs=4, max_queue=100)
    rng = np.random.default_rng(3)
    got = []

    async def consume(i: int) -> None:
        prompt = tuple(int(t) for t in rng.integers(3, 250, 1 + i % 20))
        async with sched.open(Request(prompt, 50, Sampling(), frozenset())) as g:
            async for _ in g:
                if g.completion_tokens >= i % 3 + 1:
                    break               # the client goes away mid-stream
        got.append(g.completion_tokens)

    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        async with trio.open_nursery() as clients:
            for i in range(100):
                clients.start_soon(consume, i)
        with trio.fail_after(30):        # the last leavers' slots are zeroed at the scheduler's next turn
            await sched.wait_idle()
        st = sched.stats()
        assert (st.active, st.queued, len(sched._core.free)) == (0, 0, 4)
        nursery.cancel_scope.cancel()
    assert len(got) == 100 and all(n >= 1 for n in got)
    assert len(local.zeroed) == 100                   # one ZeroSlot for each sequence
    assert set(local.zeroed) == {0, 1, 2, 3} and local.stage._lengths[:4] == [0, 0, 0, 0]


async def test_a_small_kv_pool_admits_what_fits_and_tables_follow_the_sequences(local):
    """The scheduler as the chain's block allocator (kv_blocks): 12 blocks of 16 positions hold 3-4 of the 8
    streams at once; the rest wait for blocks, not slots. Tables reach the stage ahead of
    the steps that need them, and every stream's tokens equal its run alone with the stage's full pool."""
    pipe = LocalPipeline(local)
    reqs = streams()
    alone = [await run_alone(pipe, r) for r in reqs]
    local.stage.reset()
    sched_kw = dict(kv_blocks=12)
    together, peak = await run_together(pipe, reqs, **sched_kw)
    assert together == alone
    assert 2 <= peak <= 4                                   # blocks, not the 8 slots, bounded admission
    assert local.tables and all(len(t) <= 12 and max(t) < 12 for _, t in local.tables)
    assert local.stage.free_blocks == local.stage.kv_blocks          # every block back
    sched = Scheduler(pipe, n_slots=N_SLOTS, max_context=CONTEXT, kv_blocks=12)
    with pytest.raises(ValueError, match="need 13 KV blocks of 16 positions; the stages hold 12"):
        sched.open(Request(tuple(range(3, 200)), 10))


class NoPipe(Pipeline):
    """A pipeline nobody answers: for what the scheduler decides before any step."""

    def __init__(self):
        super().__init__(None, ["nobody"])


class Posting:
    """A worker-like stage that takes a step at submit (`post_step_nowait`) and answers it at collect; each token is
    the number of the step that picked it, and the log says when steps went out and tokens reached consumers."""

    def __init__(self, hold: bool = False):
        self.log: list[tuple[str, int]] = []
        self.posted = 0
        self.hold = hold            # every answer waits forever (a scheduler cancelled mid-step)
        self.abandoned: list[int] = []

    def abandon(self, posted):
        self.abandoned.append(posted[0])

    def post_step_nowait(self, cols, data, kind, dim, sampling):
        self.posted += 1
        self.log.append(("post", self.posted))
        return self.posted, [c for c in cols if c.needs_logits]

    async def step_posted(self, posted):
        await trio.lowlevel.checkpoint()
        if self.hold:
            await trio.sleep_forever()
        n, picks = posted

        class Out:
            def array(self):
                return np.full(len(picks), n, np.int32)
        return Out()

    async def zero_slot(self, slot): pass
    async def rollback(self, slot, pos): pass
    async def block_table(self, slot, blocks): pass
    async def reset(self): pass


async def test_the_next_step_goes_out_before_consumers_get_the_last_steps_tokens():
    stage = Posting()
    sched = Scheduler(LocalPipeline(stage), n_slots=4, max_context=64)
    reqs = [Request((5, 6, 7), 6, Sampling(), frozenset()), Request((8,), 6, Sampling(), frozenset())]

    async def consume(req):
        async with sched.open(req) as g:
            async for tok in g:
                stage.log.append(("token", tok))

    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        async with trio.open_nursery() as clients:
            for r in reqs:
                clients.start_soon(consume, r)
        nursery.cancel_scope.cancel()
    tokens = [n for what, n in stage.log if what == "token"]
    assert len(tokens) == 12 and stage.posted == max(tokens)
    for i, (what, n) in enumerate(stage.log):
        if what == "token" and n < stage.posted:    # step n's tokens are handed over once step n + 1 is out
            assert ("post", n + 1) in stage.log[:i], stage.log


async def test_a_step_posted_and_never_collected_is_given_up_when_the_scheduler_stops():
    stage = Posting(hold=True)
    pipe = LocalPipeline(stage)
    sched = Scheduler(pipe, n_slots=4, max_context=64, micro_batches=2)     # two steps in flight: the two tasks
    async with trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        gens = [sched.open(Request((5, 6, 7), 4, Sampling(), frozenset())),
                sched.open(Request((8, 9), 4, Sampling(), frozenset()))]
        while stage.posted < 2:
            await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    # step 1 was being collected (its wait cancelled, the worker's own finally frees it); step 2 was never collected
    assert stage.posted == 2 and stage.abandoned == [2] and not pipe._posted
    for g in gens:
        with pytest.raises(SchedulerStopped):
            await g.__anext__()


def test_the_bounded_queue_raises_queue_full():
    sched = Scheduler(NoPipe(), n_slots=2, max_context=64, max_queue=2)
    req = Request((1, 2, 3), 4, Sampling(), frozenset())
    for _ in range(4):                  # 2 take the free slots at once (before any step), 2 wait
        sched.open(req)
    with pytest.raises(QueueFull, match="queue holds 2"):
        sched.open(req)
    assert (sched.stats().active, sched.stats().queued) == (2, 2)


def test_bad_requests_are_named():
    sched = Scheduler(NoPipe(), n_slots=3, max_context=64, vocab_size=100)
    for req, msg in [(Request((), 4), "prompt is empty"), (Request((1,), 0), "max_tokens must be at least 1"),
                     (Request(tuple(range(64)), 4), "prompt has 64 tokens; the context holds 64"),
                     (Request((1, 100), 4), "token id 100 is outside the vocabulary")]:
        with pytest.raises(ValueError, match=msg):
            sched.open(req)


async def test_a_failing_pipeline_stops_every_generation():
    class Broken(NoPipe):
        async def submit(self, cols, sampling):
            return self.next_group()

        async def collect(self, group):
            raise proto.ProtocolError(proto.ErrorCode.INTERNAL, "stage 2 is gone")

    sched = Scheduler(Broken(), n_slots=3, max_context=64)
    g = sched.open(Request((1, 2), 4))
    with pytest.raises(proto.ProtocolError):
        await sched.run()
    with pytest.raises(SchedulerStopped, match="stage 2 is gone"):
        async with g:
            async for _ in g:
                pass
    with pytest.raises(SchedulerStopped):
        sched.open(Request((1, 2), 4))


def test_a_long_prompt_never_holds_decoding_streams_for_more_than_one_chunk():
    core = _Core(slots=range(4), max_queue=8, depth=1, prefill_chunk=16)
    decoding = [_Seq(None, Request((1,) * 3, 100), 100) for _ in range(2)]
    for s in decoding:
        core.enqueue(s)
    core.admit()
    for s in decoding:                 # both already past their prompts
        s.fed, s.pos, s.next_tok = 3, 3, 7
    long = _Seq(None, Request((1,) * 100, 5), 5)
    core.enqueue(long)
    core.admit()
    kinds = []
    while long.prefilling:
        b = core.form()
        kinds.append((b.kind, len(b.cols)))
        core.apply(b, [9] * sum(c.needs_logits for c in b.cols))
    # decode batches of both streams alternate with chunks of at most 16 prompt columns
    assert kinds[:4] == [("decode", 2), ("prefill", 16), ("decode", 2), ("prefill", 16)]
    assert max(n for k, n in kinds if k == "prefill") <= 16 and kinds.count(("decode", 2)) >= 6


def test_decoding_streams_spread_over_the_micro_batches_in_flight():
    core = _Core(slots=range(8), max_queue=8, depth=3, prefill_chunk=16)
    seqs = [_Seq(None, Request((1,), 100), 100) for _ in range(8)]
    for s in seqs:
        core.enqueue(s)
    core.admit()
    for s in seqs:
        s.fed, s.pos, s.next_tok = 1, 1, 7
    sizes = []
    while (b := core.form()) is not None:
        sizes.append(len(b.cols))
    assert sizes == [3, 3, 2]           # three micro-batches, every sequence in one


@asynccontextmanager
async def three_peer_chain(model, n_slots: int):
    """A coordinator and 3 in-process peers (each computes in its own worker process), wired peer to peer."""
    cfg = CoordConfig(model=model, listen="127.0.0.1:0", token=TOKEN, min_peers=3, settle=0.2, wait=60,
                      n_slots=n_slots, max_context=CONTEXT, warmup=0)
    async with trio.open_nursery() as nursery:
        coord = Coordinator(cfg)
        port = await coord.serve_registry(nursery)
        for _ in range(3):
            # the peers' own slots and context are the defaults: the session's come with Load
            peer = Peer(PeerConfig(join=f"127.0.0.1:{port}", token=TOKEN, listen="127.0.0.1:0", model=model,
                                   warmup=0))
            nursery.start_soon(peer.run)
        async with AsyncExitStack() as stack:
            fleet, pipe = await coord.form(nursery, stack)
            yield pipe, min(i.kv_blocks for i in fleet.infos)
        nursery.cancel_scope.cancel()


@pytest.mark.slow    # three worker processes, each compiling its step shapes (~25 s with tinygrad's caches warm)
async def test_eight_streams_over_a_three_peer_chain_equal_the_unsharded_engine_alone(model, local):
    reqs = sampled(streams())      # greedy and seeded sequences in the same steps: one Sampling per column on the wire
    alone = [await run_alone(LocalPipeline(local), r) for r in reqs]
    with trio.fail_after(300):
        async with three_peer_chain(model, N_SLOTS) as (pipe, kv_blocks):
            # 3 micro-batches in flight; 6 slots keep decode batches at 1-2 columns (fewer shapes to compile);
            # the scheduler hands out the KV blocks of the stages' pools (BlockTable down the chain)
            assert kv_blocks == N_SLOTS * CONTEXT // 16
            together, peak = await run_together(pipe, reqs, micro_batches=3, max_seqs=6, kv_blocks=kv_blocks)
    assert peak == 6
    for i in range(len(reqs)):
        assert together[i] == alone[i], f"stream {i}"


def test_decode_widths_for_a_session():
    from mesh.scheduler import decode_widths
    assert decode_widths(8, 3) == 3 and decode_widths(8, 1) == 8 and decode_widths(3, 3) == 1
    assert decode_widths(1, 1) == 1 and decode_widths(9, 3) == 3
    one = Scheduler(NoPipe(), n_slots=1, max_context=64)
    assert one.stats().max_seqs == 1


def test_a_lone_decode_step_is_one_column():
    """No companion: a sequence decoding alone gets steps of its one column (the engine's one-column matvec sums
    in the GEMM's order, so its tokens equal those it gets in any batch: the 8-stream tests above)."""
    core = _Core(slots=range(4), max_queue=8, depth=1, prefill_chunk=16)
    seq = _Seq(None, Request((1, 2, 3), 5), 5)
    core.enqueue(seq)
    core.admit()
    prompt = core.form()
    assert prompt.kind == "prefill" and core.apply(prompt, [7]) == [(seq, 7, None)]
    b = core.form()
    assert (b.kind, b.cols, b.seqs) == ("decode", [Column(3, seq.slot, True, 7)], [seq])
