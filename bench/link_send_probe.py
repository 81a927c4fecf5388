"""How long Link.send of one small frame (a Done, as the last stage sends per token) takes over sealed loopback TCP,
and how much of it is the stream's send_all: the floor under the "send" phase bench/mesh_bench.py prints per stage."""
import time, statistics, trio
from mesh.link import open_link
from mesh import proto

N = 3000
async def main():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    got = trio.Event()
    async def server(stream):
        async with open_link(stream, token=b"k" * 24, role="server") as link:
            for _ in range(N):
                await link.receive()
            got.set()
            await trio.sleep(0.5)
    async with trio.open_nursery() as n:
        n.start_soon(trio.serve_listeners, server, listeners)
        s = await trio.open_tcp_stream("127.0.0.1", port)
        async with open_link(s, token=b"k" * 24, role="client") as link:
            inner = link.stream.send_all
            tw = []
            async def timed(data):
                t = time.perf_counter(); await inner(data); tw.append(time.perf_counter() - t)
            link.stream.send_all = timed
            ts = []
            for i in range(N):
                t3 = time.perf_counter()
                await link.send(proto.Done(i, (42,)))
                ts.append(time.perf_counter() - t3)
                await trio.sleep(0)
            await got.wait()
        for name, xs in (("Link.send", ts), ("send_all", tw)):
            print(f"{name:12s} median {statistics.median(xs)*1e6:8.1f} us  p90 {sorted(xs)[int(.9*len(xs))]*1e6:8.1f} us")
        n.cancel_scope.cancel()
trio.run(main)
