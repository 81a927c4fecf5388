"""The differences between the systems a peer runs on (Linux, macOS on Apple Silicon or Intel), in one place.

Every function takes the platform (and whatever it reads from the machine) as arguments, defaulting to this
machine's, so each branch is unit-tested on Linux by injecting another platform (tests/test_platform.py). No machine
of this project runs macOS: NOTES "Platforms" lists what has and has not been run on a Mac.

- the default device: CPU on a Linux machine with no trace of an accelerator, METAL on a Mac with the Metal
  framework, else tinygrad's own choice; METAL falls back to CPU where Metal is absent (`device_fallback`);
- memory: read through psutil (sysctl/vm_stat on macOS, /proc/meminfo on Linux: psutil knows both); the default
  budget of a Mac with Apple Silicon counts what its GPU may wire of the RAM it shares with the CPU;
- shared memory for the worker's arena: a memfd on Linux; elsewhere a POSIX shm object under a name that fits
  macOS's 31 bytes, unlinked as soon as it is open (nothing is left behind if a process dies).
"""
from __future__ import annotations

import os
import platform as _platform
import secrets
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class Platform:
    system: str      # sys.platform: "linux", "darwin", ...
    machine: str     # platform.machine(), lower case: "x86_64", "arm64", "aarch64"

    @property
    def macos(self) -> bool:
        return self.system == "darwin"

    @property
    def apple_silicon(self) -> bool:
        return self.macos and self.machine in ("arm64", "aarch64")

    @property
    def unified_memory(self) -> bool:
        """GPU and CPU share one RAM (Apple Silicon): a model on METAL takes the memory the CPU would have had."""
        return self.apple_silicon


def current() -> Platform:
    return Platform(sys.platform, _platform.machine().lower())


# ---- devices -----------------------------------------------------------------------------------------------------
METAL_FRAMEWORK = "/System/Library/Frameworks/Metal.framework"
# what an accelerator tinygrad could open leaves on a Linux machine: NVIDIA's and AMD's device nodes, a DRM GPU
# (OpenCL, Intel/AMD), an OpenCL ICD, WSL's GPU bridge, Qualcomm's KGSL
LINUX_ACCELERATOR_TRACES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dri", "/etc/OpenCL/vendors",
                            "/dev/dxg", "/dev/kgsl-3d0")


def has_metal(plat: Platform, exists: Callable[[str], bool] = os.path.exists) -> bool:
    return plat.macos and exists(METAL_FRAMEWORK)


def default_device(plat: Platform, *, exists: Callable[[str], bool] = os.path.exists,
                   ask: Callable[[], str]) -> str:
    """The device to use when none is named. tinygrad's own default opens every backend in turn (~1 s of a cold
    start on a Linux machine with none; NV alone 0.6 s); where the answer is plain it is given without asking."""
    if plat.system.startswith("linux") and not any(exists(p) for p in LINUX_ACCELERATOR_TRACES):
        return "CPU"
    if plat.macos:
        return "METAL" if has_metal(plat, exists) else "CPU"
    return ask()


def device_fallback(kind: str, plat: Platform, *, exists: Callable[[str], bool] = os.path.exists) -> str:
    """Why `kind` (a DEV name without renderer, upper case) cannot run here, or "" when nothing speaks against it.
    The caller falls back to CPU on a reason (METAL -> CPU)."""
    if kind == "METAL" and not plat.macos:
        return "METAL needs macOS"
    if kind == "METAL" and not has_metal(plat, exists):
        return f"METAL: no Metal framework at {METAL_FRAMEWORK}"
    return ""


def compiler_hint(plat: Platform) -> str:
    """How to get the C compiler tinygrad's CPU device needs, on this system."""
    if plat.macos:
        return "install Apple's command-line tools (xcode-select --install), which provide clang"
    return "install clang (apt-get install clang)"


# ---- memory ------------------------------------------------------------------------------------------------------
METAL_WORKING_SET = 0.75   # of RAM: about what macOS lets the GPU wire (MTLDevice.recommendedMaxWorkingSetSize)


@dataclass(frozen=True, slots=True)
class Memory:
    total_mb: int
    available_mb: int    # what can be taken without swapping (free + reclaimable caches)


def read_memory(virtual_memory: Callable[[], object] | None = None) -> Memory | None:
    """This machine's memory, portably (psutil); None where it cannot be read."""
    try:
        if virtual_memory is None:
            import psutil
            virtual_memory = psutil.virtual_memory
        vm = virtual_memory()
        return Memory(int(vm.total // 2**20), int(vm.available // 2**20))
    except Exception:  # noqa: BLE001 (psutil missing or refused by a sandbox: memory is unknown, 0 in the Join)
        return None


def memory_budget_mb(plat: Platform, mem: Memory | None, device: str = "") -> int:
    """The default memory a peer offers the planner (its Join; `--memory-gb` overrides): what is available now.
    With unified memory and a GPU device, also no more than the share of RAM the GPU may wire: on Apple Silicon
    METAL buffers live in the same RAM as everything else, up to about METAL_WORKING_SET of it."""
    if mem is None:
        return 0
    budget = mem.available_mb
    if plat.unified_memory and device.upper().split(":")[0] != "CPU":
        budget = min(budget, int(mem.total_mb * METAL_WORKING_SET))
    return max(budget, 0)


# ---- shared memory -----------------------------------------------------------------------------------------------
SHM_NAME_MAX = 31          # macOS's PSHMNAMLEN: longer POSIX shm names fail with ENAMETOOLONG (Linux allows 255)


def shm_name(pid: int | None = None, token: str | None = None) -> str:
    """A POSIX shm name unique to this process and call, within macOS's 31 bytes: "/mesh-<pid hex>-<12 hex>"."""
    name = f"/mesh-{(os.getpid() if pid is None else pid) & 0xFFFFFFFF:x}-{token or secrets.token_hex(6)}"
    if len(name) > SHM_NAME_MAX:
        raise ValueError(f"shm name {name!r} is longer than {SHM_NAME_MAX} bytes")
    return name


def shared_memory_fd(size: int, plat: Platform) -> int:
    """A file descriptor of `size` bytes of anonymous shared memory, to be mapped here and passed to a child."""
    if plat.system.startswith("linux") and hasattr(os, "memfd_create"):
        fd = os.memfd_create("mesh-arena", os.MFD_CLOEXEC)
    else:
        import _posixshmem
        name = shm_name()
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _posixshmem.shm_unlink(name)      # the open fd (here and in the child) keeps it; nothing left if we die
        os.set_inheritable(fd, False)
    try:
        os.ftruncate(fd, size)            # macOS sizes a shm object once, before it is mapped: this is that once
    except OSError:
        os.close(fd)
        raise
    return fd
