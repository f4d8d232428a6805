"""ZIMAGE_PINNED_GIB is checked with a one-line error; the default cap reads the RAM on every system."""
import ctypes
import os

import pytest

from zimage_core import host_memory
from zimage_core.errors import SettingError, ZImageError
from zimage_core.host_memory import HostPool

GiB = 1 << 30


@pytest.mark.parametrize("text, gib", [("4", 4), ("10.5", 10.5), (" 2 ", 2), ("0", 0), ("1e-3", 1e-3)])
def test_pinned_gib_accepts_numbers(monkeypatch, text, gib):
    monkeypatch.setenv("ZIMAGE_PINNED_GIB", text)
    assert HostPool.environment_cap() == int(gib * GiB)


@pytest.mark.parametrize("text", ["", "  "])
def test_pinned_gib_empty_is_unset(monkeypatch, text):
    monkeypatch.setenv("ZIMAGE_PINNED_GIB", text)
    assert HostPool.environment_cap() is None


def test_pinned_gib_zero_pins_nothing(monkeypatch):
    monkeypatch.setenv("ZIMAGE_PINNED_GIB", "0")
    pool = HostPool(pin=False)
    assert pool.cap == 0 and pool.allocate(1, host_memory.torch.uint8) is None


@pytest.mark.parametrize("text", ["abc", "nan", "NaN", "inf", "-inf", "-1", "-0.5", "4GB", "1,5"])
def test_pinned_gib_refuses_others(monkeypatch, text):
    monkeypatch.setenv("ZIMAGE_PINNED_GIB", text)
    with pytest.raises(SettingError) as e:
        HostPool(pin=False)
    msg = str(e.value)
    assert isinstance(e.value, ZImageError)
    assert "ZIMAGE_PINNED_GIB" in msg and repr(text.strip()) in msg and ">= 0" in msg and "0 pins nothing" in msg
    assert "\n" not in msg


def test_default_cap_linux_reads_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemFree:         1048576 kB\nMemAvailable:   20971520 kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO", str(meminfo))
    assert host_memory.default_cap() == 10 * GiB


def test_default_cap_without_meminfo_uses_sysconf(tmp_path, monkeypatch):
    """Other POSIX systems: sysconf's available pages, not a fixed 8 GiB."""
    monkeypatch.setattr(host_memory, "MEMINFO", str(tmp_path / "missing"))
    monkeypatch.setattr(host_memory.sys, "platform", "linux")
    pages = {"SC_AVPHYS_PAGES": 3 * GiB // 4096, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(host_memory.os, "sysconf", lambda name: pages[name])
    assert host_memory.default_cap() == 3 * GiB // 2


def test_default_cap_windows_uses_global_memory_status(tmp_path, monkeypatch):
    """Windows has no /proc/meminfo: GlobalMemoryStatusEx's available physical RAM, halved."""
    seen = {}

    def global_memory_status_ex(ref):
        status = ref._obj  # the structure passed by reference
        seen["length"] = status.dwLength
        status.ullTotalPhys, status.ullAvailPhys = 32 * GiB, 24 * GiB
        return 1

    class Windll:
        class kernel32:
            GlobalMemoryStatusEx = staticmethod(global_memory_status_ex)

    monkeypatch.setattr(host_memory, "MEMINFO", str(tmp_path / "missing"))
    monkeypatch.setattr(host_memory.sys, "platform", "win32")
    monkeypatch.setattr(ctypes, "windll", Windll, raising=False)
    assert host_memory.default_cap() == 12 * GiB
    assert seen["length"] == 64  # MEMORYSTATUSEX's size on Windows, what the call checks


def test_default_cap_unreadable_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(host_memory, "MEMINFO", str(tmp_path / "missing"))
    monkeypatch.setattr(host_memory.sys, "platform", "darwin")

    def no_sysconf(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(host_memory.os, "sysconf", no_sysconf)
    assert host_memory.default_cap() == 8 * GiB


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux only")
def test_sysconf_agrees_with_meminfo_roughly():
    """The POSIX fallback reads the same machine: free pages are at most what MemAvailable counts
    (plus some slack for memory freed between the two reads)."""
    avail = host_memory.available_ram()
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < free <= avail + GiB
