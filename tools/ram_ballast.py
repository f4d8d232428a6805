"""Hold host RAM so that only --leave-gib stays available (MemAvailable), like a machine with less memory.

    python tools/ram_ballast.py --leave-gib 28 --flag /tmp/ram.ready &   # wait for the flag file

Standard library only, Linux. Every page is touched so the memory is really taken (on a machine
without swap it cannot be paged out). Runs until killed; end it by its process id when done."""
import argparse
import mmap
import time


def available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("no MemAvailable in /proc/meminfo")


ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--leave-gib", type=float, required=True, help="GiB of RAM to leave available")
ap.add_argument("--flag", required=True, help="file written (available GiB) once the memory is held")
a = ap.parse_args()
hold, bufs = int(available() - a.leave_gib * 2**30), []
while hold > 0:
    n = min(1 << 30, hold)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for off in range(0, n, mmap.PAGESIZE):
        m[off] = 1
    bufs.append(m)
    hold -= n
with open(a.flag, "w") as f:
    f.write(f"{available() / 2**30:.2f}\n")
print(f"RAM ballast holds {sum(len(b) for b in bufs) / 2**30:.1f} GiB; "
      f"MemAvailable now {available() / 2**30:.1f} GiB", flush=True)
while True:
    time.sleep(3600)
