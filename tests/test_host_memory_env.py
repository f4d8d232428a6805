"""ZIMAGE_PINNED_GIB is checked with a one-line error; the host budget reads the RAM on every system and
plans it: ComfyUI's RAM-cache headroom stays free, and the transformer's claim is kept for it."""
import ctypes
import mmap
import os
import subprocess
import sys

import pytest
import torch

from zimage_core import host_memory, ram
from zimage_core.errors import SettingError, ZImageError
from zimage_core.environment import parse_pinned_gib
from zimage_core.host_memory import HostBudget, HostPool

GiB = 1 << 30


@pytest.mark.parametrize("text, gib", [("4", 4), ("10.5", 10.5), (" 2 ", 2), ("0", 0), ("1e-3", 1e-3)])
def test_pinned_gib_accepts_numbers(text, gib):
    assert parse_pinned_gib(text) == int(gib * GiB)


@pytest.mark.parametrize("text", ["", "  "])
def test_pinned_gib_empty_is_unset(text):
    assert parse_pinned_gib(text) is None


def test_pinned_gib_zero_pins_nothing(monkeypatch):
    monkeypatch.setattr(host_memory, "BUDGET", HostBudget(cap=0))  # the budget ZIMAGE_PINNED_GIB=0 gives
    pool = HostPool(pin=False)
    assert pool.room() == 0 and pool.allocate(1, host_memory.torch.uint8) is None


@pytest.mark.parametrize("text", ["abc", "nan", "NaN", "inf", "-inf", "-1", "-0.5", "4GB", "1,5"])
def test_pinned_gib_refuses_others(text):
    with pytest.raises(SettingError) as e:
        parse_pinned_gib(text)
    msg = str(e.value)
    assert isinstance(e.value, ZImageError)
    assert "ZIMAGE_PINNED_GIB" in msg and repr(text.strip()) in msg and ">= 0" in msg and "0 pins nothing" in msg
    assert "\n" not in msg


def fake_meminfo(tmp_path, monkeypatch, total_gib, avail_gib):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {total_gib * 1024 * 1024} kB\nMemFree: 1048576 kB\n"
                       f"MemAvailable: {avail_gib * 1024 * 1024} kB\n")
    monkeypatch.setattr(ram, "MEMINFO", str(meminfo))


@pytest.mark.parametrize("total, headroom", [(16, 2 * GiB), (32, int(3.2 * GiB)), (64, int(6.4 * GiB)),
                                             (256, 10 * GiB)])
def test_headroom_is_what_comfyui_keeps_by_default(tmp_path, monkeypatch, total, headroom):
    """10% of the RAM, at least 2 GB, at most 10 GB: what ComfyUI's RAM-pressure cache keeps."""
    fake_meminfo(tmp_path, monkeypatch, total, total // 2)
    assert HostBudget().headroom == headroom


def test_the_budget_keeps_the_headroom_and_other_owners_claims(tmp_path, monkeypatch):
    fake_meminfo(tmp_path, monkeypatch, 32, 28)  # a 32 GB desktop with 28 GiB available
    b = HostBudget()
    free = 28 * GiB - int(3.2 * GiB) - host_memory.WORKING_MARGIN
    assert b.room("text encoder") == free
    b.claim("transformer", 10 * GiB)  # its streamed layers, from its plan
    assert b.room("text encoder") == free - 10 * GiB and b.room("transformer") == free
    b._count("transformer", 4 * GiB)  # what it holds already is in MemAvailable; the rest stays claimed
    assert b.room("text encoder") == free - 6 * GiB
    b.claim("transformer", 40 * GiB)
    assert b.room("text encoder") == 0  # never below zero
    assert HostBudget(cap=GiB).room("transformer") == GiB - host_memory.live_bytes()


def test_the_cap_limits_the_packs_copies_not_the_page_cache(tmp_path, monkeypatch):
    """ZIMAGE_PINNED_GIB=0 leaves no room for pinned copies, and all of it for a file's page cache
    (the text encoder's): the warning that its file is read from the disk at each prompt reads
    ``ram_room``, so a cap alone never raises it."""
    fake_meminfo(tmp_path, monkeypatch, 32, 28)
    b = HostBudget(cap=0)
    assert b.room("text encoder") == 0
    assert b.ram_room("text encoder") == 28 * GiB - int(3.2 * GiB) - host_memory.WORKING_MARGIN


def test_the_environment_is_read_once_per_process():
    """The budget, the nodes and the commands read ZIMAGE_PINNED_GIB when the process first asks, once:
    a value set later changes nothing (ComfyUI reads its environment at start-up too)."""
    code = ("import os; from zimage_core import environment, host_memory; "
            "first = environment.read(); os.environ['ZIMAGE_PINNED_GIB'] = '1'; "
            "print(first.pinned_cap, environment.read().pinned_cap, host_memory.BUDGET.cap)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ZIMAGE_PINNED_GIB="4")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [str(4 * GiB)] * 3, out.stderr


def test_available_ram_without_meminfo_uses_sysconf(tmp_path, monkeypatch):
    """Other POSIX systems: sysconf's available pages, not a fixed 8 GiB."""
    monkeypatch.setattr(ram, "MEMINFO", str(tmp_path / "missing"))
    monkeypatch.setattr(ram.sys, "platform", "linux")
    pages = {"SC_AVPHYS_PAGES": 3 * GiB // 4096, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(ram.os, "sysconf", lambda name: pages[name])
    assert ram.available_ram() == 3 * GiB


def test_available_ram_windows_uses_global_memory_status(tmp_path, monkeypatch):
    """Windows has no /proc/meminfo: GlobalMemoryStatusEx's available and total physical RAM."""
    seen = {}

    def global_memory_status_ex(ref):
        status = ref._obj  # the structure passed by reference
        seen["length"] = status.dwLength
        status.ullTotalPhys, status.ullAvailPhys = 32 * GiB, 24 * GiB
        return 1

    class Windll:
        class kernel32:
            GlobalMemoryStatusEx = staticmethod(global_memory_status_ex)

    monkeypatch.setattr(ram, "MEMINFO", str(tmp_path / "missing"))
    monkeypatch.setattr(ram.sys, "platform", "win32")
    monkeypatch.setattr(ctypes, "windll", Windll, raising=False)
    assert ram.available_ram() == 24 * GiB and ram.total_ram() == 32 * GiB
    assert seen["length"] == 64  # MEMORYSTATUSEX's size on Windows, what the call checks


def test_unreadable_ram_leaves_the_budget_unbounded(tmp_path, monkeypatch):
    monkeypatch.setattr(ram, "MEMINFO", str(tmp_path / "missing"))
    monkeypatch.setattr(ram.sys, "platform", "darwin")

    def no_sysconf(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(ram.os, "sysconf", no_sysconf)
    assert ram.available_ram() is None
    b = HostBudget()
    assert b.headroom == 2 * GiB and b.room("transformer") > 1 << 40


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux only")
def test_sysconf_agrees_with_meminfo_roughly():
    """The POSIX fallback reads the same machine: free pages are at most what MemAvailable counts
    (plus some slack for memory freed between the two reads)."""
    avail = ram.available_ram()
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < free <= avail + GiB


def _anonymous_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@pytest.mark.skipif(not (hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/proc/self/status")),
                    reason="transparent huge pages are a Linux feature")
def test_a_large_buffer_is_laid_out_for_huge_pages_and_goes_back_when_freed():
    """A master-sized buffer starts on a huge page's boundary (so the kernel can back it with huge
    pages), holds what is written into it, and its memory leaves the process when the pool frees it."""
    pool = HostPool("huge-pages-test", pin=False)
    before = _anonymous_rss()
    buf = pool.allocate(48 << 20, torch.bfloat16)  # 96 MiB
    assert buf.data_ptr() % host_memory.HUGE_PAGE == 0 and buf.dtype == torch.bfloat16
    buf.fill_(1.5)
    assert pool.holds(buf[-1:]) and float(buf[-1]) == 1.5
    assert _anonymous_rss() - before >= 90 << 20
    pool.free(buf)
    del buf
    assert _anonymous_rss() - before < 16 << 20
    small = pool.allocate(1000, torch.float32)  # below a huge page: an ordinary allocation
    assert small.numel() == 1000 and pool.holds(small)
    pool.release_all()


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="transparent huge pages are a Linux feature")
def test_a_kernel_without_huge_pages_still_gives_the_buffer(monkeypatch):
    """Where the kernel refuses the advice (built without huge pages), the buffer is made in small
    pages, not refused as if the RAM had no room."""
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)  # advice no kernel knows: EINVAL
    with pytest.raises(OSError):
        mmap.mmap(-1, 4096).madvise(mmap.MADV_HUGEPAGE)
    pool = HostPool("no-huge-pages-test", pin=False)
    buf = pool.allocate(4 << 20, torch.float32)
    assert buf is not None and buf.numel() == 4 << 20
    buf.fill_(2.0)
    assert float(buf.sum()) == 2.0 * (4 << 20)
    pool.release_all()
