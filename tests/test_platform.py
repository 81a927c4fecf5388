"""engine.platform: every branch, by injecting the platform (no machine here runs macOS)."""
import os
import sys
from types import SimpleNamespace

import pytest

from engine import platform as P
from engine.arena import Arena
from engine.device import DeviceError, choose_device, cpu_choice

LINUX = P.Platform("linux", "x86_64")
LINUX_ARM = P.Platform("linux", "aarch64")
MAC_ARM = P.Platform("darwin", "arm64")
MAC_INTEL = P.Platform("darwin", "x86_64")
METAL_THERE = (lambda p: p == P.METAL_FRAMEWORK)
NOTHING = (lambda p: False)


def test_platform_kinds():
    assert MAC_ARM.macos and MAC_ARM.apple_silicon and MAC_ARM.unified_memory
    assert MAC_INTEL.macos and not MAC_INTEL.apple_silicon and not MAC_INTEL.unified_memory
    assert not LINUX.macos and not LINUX_ARM.unified_memory
    assert P.current().system == sys.platform


def test_default_device_per_platform():
    ask = lambda: "CUDA"  # noqa: E731
    assert P.default_device(LINUX, exists=NOTHING, ask=ask) == "CPU"
    assert P.default_device(LINUX, exists=lambda p: p == "/dev/kfd", ask=ask) == "CUDA"
    assert P.default_device(MAC_ARM, exists=METAL_THERE, ask=ask) == "METAL"
    assert P.default_device(MAC_INTEL, exists=METAL_THERE, ask=ask) == "METAL"
    assert P.default_device(MAC_ARM, exists=NOTHING, ask=ask) == "CPU"


def _which(present):
    return lambda name: f"/usr/bin/{name}" if name in present else None


def test_metal_falls_back_to_cpu_where_there_is_no_metal():
    on_mac = choose_device("METAL", default=lambda: "METAL", which=_which({"clang"}), is_clang=lambda cc: True,
                           plat=MAC_ARM, exists=METAL_THERE)
    assert (on_mac.selected, on_mac.reason) == ("METAL", "")
    no_framework = choose_device("METAL", default=lambda: "METAL", which=_which({"clang"}), is_clang=lambda cc: True,
                                 plat=MAC_ARM, exists=NOTHING)
    assert no_framework.selected == "CPU" and "no Metal framework" in no_framework.reason
    on_linux = choose_device("METAL", default=lambda: "METAL", which=_which(set()), is_clang=lambda cc: False,
                             plat=LINUX, exists=NOTHING)
    assert on_linux.selected == "CPU:X86" and on_linux.reason == "METAL needs macOS; clang not found on PATH"


def test_cpu_without_clang_on_arm_says_how_to_get_it(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(DeviceError, match=r"xcode-select --install"):
        cpu_choice("CPU", MAC_ARM, which=_which(set()), is_clang=lambda cc: False)
    with pytest.raises(DeviceError, match=r"apt-get install clang"):
        cpu_choice("CPU", LINUX_ARM, which=_which(set()), is_clang=lambda cc: False)
    assert cpu_choice("CPU", MAC_INTEL, which=_which(set()), is_clang=lambda cc: False).selected == "CPU:X86"
    assert cpu_choice("CPU", MAC_ARM, which=_which({"clang"}), is_clang=lambda cc: True).selected == "CPU"


def test_memory_is_read_portably_and_budgeted_for_unified_memory():
    vm = lambda: SimpleNamespace(total=32 << 30, available=28 << 30)  # noqa: E731
    mem = P.read_memory(vm)
    assert mem == P.Memory(32768, 28672)
    assert P.memory_budget_mb(LINUX, mem, "CPU") == 28672
    assert P.memory_budget_mb(LINUX, mem, "CUDA") == 28672         # a discrete GPU's own memory is not read here
    assert P.memory_budget_mb(MAC_INTEL, mem, "METAL") == 28672    # Intel Macs: the GPU has its own memory
    assert P.memory_budget_mb(MAC_ARM, mem, "METAL") == 24576      # at most the GPU's wired share of the RAM
    assert P.memory_budget_mb(MAC_ARM, mem, "CPU") == 28672
    assert P.memory_budget_mb(MAC_ARM, P.Memory(32768, 8000), "METAL") == 8000
    assert P.memory_budget_mb(LINUX, None, "CPU") == 0
    assert P.read_memory(lambda: 1 / 0) is None
    assert P.read_memory().total_mb > 0                             # this machine, through psutil


def test_shm_names_fit_macos_limit():
    names = {P.shm_name() for _ in range(100)}
    assert len(names) == 100
    assert all(n.startswith("/mesh-") and len(n) <= P.SHM_NAME_MAX for n in names)
    assert len(P.shm_name(pid=2**32 - 1)) <= P.SHM_NAME_MAX        # the largest pid still fits
    with pytest.raises(ValueError, match="longer than 31"):
        P.shm_name(token="x" * 30)


@pytest.mark.parametrize("plat", [LINUX, MAC_ARM], ids=["memfd", "posix-shm"])
def test_shared_memory_of_each_kind_maps_and_leaves_nothing_behind(plat):
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    arena = Arena.create(1 << 20, platform=plat)        # the shm branch runs here too: Linux has shm_open
    try:
        other = Arena.attach(arena.fd, arena.size)
        other.buffer[100:104] = b"mesh"
        assert arena.buffer[100:104] == b"mesh"
        other.close()
        assert not os.get_inheritable(arena.fd)
        assert os.fstat(arena.fd).st_size >= 1 << 20
    finally:
        arena.close()
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {n for n in after - before if n.startswith("mesh-")}   # unlinked at once
