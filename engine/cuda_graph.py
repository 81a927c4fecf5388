"""A CUDA graph that re-parameterizes only what changed, from one block of argument memory.

tinygrad's `CUDAGraph.__call__` rewrites, on every call, every variable of every node that has one (a Python
`setattr` each) and hands every such node back to the driver (`cuGraphExecKernelNodeSetParams`). A decode step of 16
sequences binds 16 slots, 16 positions and ctx, which every layer's rope/KV-write and attention kernels read: on the
H200 that was ~1450 `setattr` and 79 driver calls a step, 1.8-1.9 ms of host a step (bench/RESULTS.md "Ninth
session: the H200's 16 streams"); with this class the host's launch part is 0.41 ms against 0.84 in the same process,
and the step is bound by its GPU time ("Tenth session: the lean CUDA graph"). Kernels, their order, arguments and
launch sizes are unchanged here, so results are bit-identical; only how the host writes the arguments differs:

- every updatable kernel node's argument struct is moved into one numpy byte block (the node's `extra` launch
  parameters point at its new place), so the step's variables land in all of them with one vectorized scatter;
- a node goes back to the driver only when one of its own inputs changed since the last call: a variable's value,
  a launch size that follows a variable, or an input buffer's address (a stage's step inputs are the same buffers
  every step, so those nodes mostly stay as they are; slots of steady sequences do not change either);
- the driver entry points are called directly, without the wrapper's per-call Python.

Installed per device by `install` (engine/stage.py, for CUDA devices); `MESH_LEAN_GRAPH=0` keeps tinygrad's own.
Memcpy nodes keep tinygrad's path. Nothing here runs without a CUDA device.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

__all__ = ["install"]


def install(device: str) -> bool:
    """Make `device`'s graphs lean (graphs built from now on). False where the device has no CUDA graph, or
    MESH_LEAN_GRAPH=0."""
    if os.environ.get("MESH_LEAN_GRAPH") == "0" or not device.upper().startswith("CUDA"):
        return False
    from tinygrad import Device
    from tinygrad.engine.jit import graph_class
    from tinygrad.runtime.graph.cuda import CUDAGraph

    dev = Device[device]
    if dev.graph is None or graph_class(dev) is not CUDAGraph:
        return graph_class(dev) is _lean_class() if dev.graph is not None else False
    dev.graph = _lean_class()
    return True


_LEAN: type | None = None


def _lean_class() -> type:
    """The subclass, built on first use (importing tinygrad's CUDA graph needs nothing of CUDA, but keep CPU-only
    imports of this module free of it)."""
    global _LEAN
    if _LEAN is not None:
        return _LEAN
    import tinygrad.runtime.autogen.cuda as cuda
    from tinygrad.runtime.graph.cuda import CUDAGraph
    from tinygrad.runtime.ops_cuda import check, cu_time_execution
    from tinygrad.uop.ops import sym_infer

    class LeanCUDAGraph(CUDAGraph):
        def __init__(self, linear, input_uops=()):
            super().__init__(linear, input_uops)
            self._lean_ready = False

        def _lean_setup(self) -> None:
            kernels = [j for j in self.updatable if not self.nodes[j][3]]
            sizes = [ctypes.sizeof(self.nodes[j][2]) for j in kernels]
            offs = np.cumsum([0] + [-(-s // 8) * 8 for s in sizes])  # 8-aligned: pointers and 64-bit values
            self._mem = mem = np.zeros(max(int(offs[-1]), 8), np.uint8)
            self._keep: list = []
            where: dict[int, int] = {}
            for j, off, size in zip(kernels, offs, sizes):
                node, params, c_args, _ = self.nodes[j]
                moved = type(c_args).from_buffer(mem, int(off))
                ctypes.memmove(ctypes.addressof(moved), ctypes.addressof(c_args), size)
                size_t = ctypes.c_size_t(size)
                extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(moved), 2, ctypes.addressof(size_t), 0)
                params.extra = ctypes.cast(extra, ctypes.POINTER(ctypes.c_void_p))
                self._keep += [extra, size_t]
                self.nodes[j] = (node, params, moved, False)
                where[j] = int(off)
            # every variable entry: (byte offset in the block, width, the variable's index in self.vars, the node)
            entries: list[tuple[int, int, int, int]] = []
            for j, reps in self.var_vals_replace.items():
                if j not in where:
                    continue
                c_args = self.nodes[j][2]
                for i, v in reps:
                    off, width = _field(c_args, f"v{i}")
                    entries.append((where[j] + off, width, v, j))
            by_width = {}
            for width in (4, 8):
                sel = [e for e in entries if e[1] == width]
                if sel:
                    by_width[width] = (np.array([e[0] // width for e in sel], np.int64),
                                       np.array([e[2] for e in sel], np.int64))
            if any(e[1] not in (4, 8) or e[0] % e[1] for e in entries):
                raise RuntimeError("a kernel variable's argument is not an aligned 32- or 64-bit integer")
            self._by_width = by_width
            self._views = {4: mem.view(np.int32), 8: mem.view(np.int64)}
            # which nodes each variable feeds (a node is re-sent when any of its variables changed)
            self._var_nodes = [sorted({e[3] for e in entries if e[2] == v}) for v in range(len(self.vars))]
            self._buf_slots = [(j, where[j] + 8 * p, i) for j in kernels for p, i in self.uop_replace[j]]
            self._copies = [j for j in self.updatable if self.nodes[j][3]]
            self._last_vals: list | None = None
            self._last_bufs: list | None = None
            self._last_dims: list | None = None
            # the driver's entry points as plain function pointers (own argtypes: tinygrad's wrappers keep theirs)
            fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
            self._set = fn(ctypes.cast(cuda.dll.cuGraphExecKernelNodeSetParams, ctypes.c_void_p).value)
            self._launch = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
                ctypes.cast(cuda.dll.cuGraphLaunch, ctypes.c_void_p).value)
            self._handles = {j: (ctypes.cast(self.nodes[j][0], ctypes.c_void_p).value,
                                 ctypes.addressof(self.nodes[j][1])) for j in kernels}
            self._instance = ctypes.cast(self.instance, ctypes.c_void_p).value
            self._lean_ready = True

        def __call__(self, input_uops, var_vals, wait=False):
            if not self._lean_ready:
                self._lean_setup()
            dirty: set[int] = set()
            vals = [var_vals[v] for v in self.vars]
            last = self._last_vals
            if last != vals:
                for v, (a, b) in enumerate(zip(vals, last)) if last is not None else ():
                    if a != b:
                        dirty.update(self._var_nodes[v])
                if last is None:
                    dirty.update(j for nodes in self._var_nodes for j in nodes)
                arr = np.array(vals, np.int64)
                for width, (idx, var) in self._by_width.items():
                    self._views[width][idx] = arr[var]
                self._last_vals = vals
            bufs = [_address(input_uops[i].buffer, self.calls[j][0]) for j, _, i in self._buf_slots]
            if bufs != self._last_bufs:
                view = self._views[8]
                for k, ((j, off, _), ptr) in enumerate(zip(self._buf_slots, bufs)):
                    if self._last_bufs is None or self._last_bufs[k] != ptr:
                        view[off // 8] = ptr
                        dirty.add(j)
                self._last_bufs = bufs
            if self.launch_dims_replace:
                dims = [tuple(sym_infer(s, var_vals) for s in dim) for dim in self.symbolic_dims]
                if dims != self._last_dims:
                    for j, global_dims, local_dims in self.updated_launch_dims(var_vals):
                        p = self.nodes[j][1]
                        new = (*local_dims, *global_dims)
                        if (p.blockDimX, p.blockDimY, p.blockDimZ, p.gridDimX, p.gridDimY, p.gridDimZ) != new:
                            p.blockDimX, p.blockDimY, p.blockDimZ, p.gridDimX, p.gridDimY, p.gridDimZ = new
                            dirty.add(j)
                    self._last_dims = dims
            instance, handles = self.instance, self._handles
            for j in sorted(dirty):
                if (h := handles.get(j)) is not None:
                    check(self._set(self._instance, *h))
            if self._copies:  # memcpy nodes: tinygrad's own path (input buffers in the copy's params)
                for j in self._copies:
                    (node, params, ctx_, _), dev_idx = self.nodes[j], self.calls[j][0]
                    for pos, iidx in self.uop_replace[j]:
                        b = input_uops[iidx].buffer
                        buf = b.bufs[dev_idx] if hasattr(b, "bufs") else b
                        setattr(params, "srcDevice" if pos == 1 else "dstDevice", buf._buf)
                    check(cuda.cuGraphExecMemcpyNodeSetParams(instance, node, ctypes.byref(params), ctx_))
            return cu_time_execution(lambda: check(self._launch(self._instance, None)), enable=wait)

    _LEAN = LeanCUDAGraph
    return _LEAN


def _address(buf, dev_idx: int) -> int:
    """A jit input's device address (a MultiBuffer's part on this graph's device); tinygrad keeps CUDA addresses
    as ctypes integers."""
    raw = (buf.bufs[dev_idx] if hasattr(buf, "bufs") else buf)._buf
    return raw.value if hasattr(raw, "value") else int(raw)


def _field(struct, name: str) -> tuple[int, int]:
    """(byte offset, width) of a field of tinygrad's argument struct (`encode_args`: fields f0.. pointers, v0..
    integers, registered with their offsets)."""
    for entry in type(struct)._real_fields_:
        if entry[0] == name:
            return entry[2], ctypes.sizeof(entry[1])
    raise KeyError(name)
