"""Choosing the tinygrad device for a worker, with the fallbacks a bare machine needs, and probing it.

tinygrad 0.14 names a device and its renderer in one `DEV` value (`CPU`, `CPU:X86`, `CUDA`, `CUDA:PTX`); the older
`CUDA_PTX=1` style variables now trip an assertion, so the fallbacks are expressed as `DEV` values:
- CPU without its C compiler (`$CC`, else `clang`) on PATH -> `CPU:X86` (tinygrad's own x86 backend, about 2x
  slower, needs no compiler);
- CUDA without `nvcc` on PATH -> `CUDA:PTX` (PTX handed to the driver, no CUDA toolkit needed);
- METAL where there is no Metal (not macOS, or no Metal framework) -> CPU, then CPU's own fallback; the worker also
  falls back to CPU when METAL fails its probe (engine/worker_main.py).
On an ARM machine (Apple Silicon) there is no compiler-free CPU renderer: CPU without clang is an error that says how
to get it (engine/platform.py has the per-system differences).
A `$CC` that is not clang (gcc, as on some CUDA images) counts as missing: tinygrad passes it clang-only flags. Where
NVRTC does not load, tinygrad itself moves on to its PTX renderer. A DEV that already names a renderer is kept.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from engine import platform as plat_mod
from engine.errors import EngineError


class DeviceError(EngineError):
    """The device cannot be selected or does not compute correctly."""


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    requested: str | None
    selected: str  # the DEV value to run with
    compiler: str  # "default", "x86" or "ptx"
    reason: str  # why a fallback was taken; "" when none was


@dataclass(frozen=True, slots=True)
class Probe:
    device: str
    values: tuple[int, ...]
    ms: float


def is_clang(cc: str) -> bool:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "clang" in out.lower()


def choose_device(requested: str | None, *, default: Callable[[], str],
                  which: Callable[[str], str | None] = shutil.which,
                  is_clang: Callable[[str], bool] = is_clang,
                  plat: plat_mod.Platform | None = None,
                  exists: Callable[[str], bool] = os.path.exists) -> DeviceChoice:
    """Resolve `requested` (None: the DEV environment variable, else tinygrad's own default, asked lazily through
    `default`) and apply the fallbacks."""
    plat = plat or plat_mod.current()
    name = requested if requested is not None else (os.environ.get("DEV") or default())
    name = name.strip()
    if not name or any(c.isspace() for c in name):
        raise DeviceError(f"device name {name!r} is empty or holds whitespace")
    kind, _, rest = name.partition(":")
    kind = kind.upper()
    if rest:
        return DeviceChoice(requested, name, "default", "")
    if why := plat_mod.device_fallback(kind, plat, exists=exists):
        cpu = cpu_choice(requested, plat, which=which, is_clang=is_clang)
        return DeviceChoice(requested, cpu.selected, cpu.compiler, "; ".join(r for r in (why, cpu.reason) if r))
    if kind == "CPU":
        return cpu_choice(requested, plat, which=which, is_clang=is_clang)
    if kind == "CUDA" and which("nvcc") is None:
        return DeviceChoice(requested, "CUDA:PTX", "ptx", "nvcc not found on PATH")
    return DeviceChoice(requested, name, "default", "")


def cpu_choice(requested: str | None, plat: plat_mod.Platform, *, which: Callable[[str], str | None] = shutil.which,
               is_clang: Callable[[str], bool] = is_clang) -> DeviceChoice:
    """CPU with clang, else tinygrad's x86 renderer on an x86 machine; an ARM machine has no compiler-free renderer."""
    cc = os.environ.get("CC", "clang")  # tinygrad's CPU renderer runs $CC, else clang
    why = f"{cc} not found on PATH" if which(cc) is None else \
        "" if is_clang(cc) else f"{cc} is not clang (tinygrad passes it clang-only flags)"
    if not why:
        return DeviceChoice(requested, "CPU", "default", "")
    if plat.machine not in ("x86_64", "amd64", "i686", "x86"):
        raise DeviceError(f"CPU needs clang on {plat.machine} ({why}): {plat_mod.compiler_hint(plat)}")
    return DeviceChoice(requested, "CPU:X86", "x86", why)


def apply_device(choice: DeviceChoice) -> None:
    """Make `choice` tinygrad's default device in this process (and in processes it spawns)."""
    os.environ["DEV"] = choice.selected
    from tinygrad.helpers import DEV
    DEV.value = choice.selected


def tinygrad_default() -> str:
    from tinygrad import Device
    return Device.DEFAULT


def quick_default(*, platform: str = sys.platform, exists: Callable[[str], bool] = os.path.exists,
                  ask: Callable[[], str] = tinygrad_default, machine: str | None = None) -> str:
    """tinygrad's own default opens every backend in turn (METAL, AMD, NV, CUDA, QCOM, CL, ... CPU) and keeps the
    first that opens: ~1 s of a cold start on a Linux machine that has none of them (NV alone 0.6 s). Where the
    answer is plain (engine.platform.default_device) it is given without asking; elsewhere tinygrad decides."""
    plat = plat_mod.Platform(platform, machine if machine is not None else plat_mod.current().machine)
    return plat_mod.default_device(plat, exists=exists, ask=ask)


def probe_device() -> Probe:
    """Realize a tiny tensor on the default device and read it back; raises DeviceError if that fails or reads
    wrong. The first realize also compiles a kernel, so this proves the compiler too."""
    t0 = time.perf_counter()
    device = os.environ.get("DEV", "?")
    try:
        from tinygrad import Device, Tensor, dtypes
        device = Device.DEFAULT
        values = tuple(int(v) for v in (Tensor([1, 2, 3], dtype=dtypes.int32, device=device) * 2).realize().tolist())
    except Exception as exc:  # tinygrad raises many kinds of errors for a missing device or compiler
        raise DeviceError(f"device {device} failed its probe: {type(exc).__name__}: {exc}") from exc
    if values != (2, 4, 6):
        raise DeviceError(f"device {device} computed {list(values)} for [1,2,3]*2")
    return Probe(device, values, (time.perf_counter() - t0) * 1000)
