"""Hold GPU memory so that only --leave-gib stays free, like a smaller card (needs torch with CUDA).

    python tools/ballast.py --leave-gib 7.5 --flag /tmp/gpu.ready &   # wait for the flag file, then benchmark

The program under test then sees what such a card shows (`cudaMemGetInfo` reports --leave-gib free).
Runs until killed; end it by its process id when done."""
import argparse
import time

import torch

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--leave-gib", type=float, required=True, help="GiB of GPU memory to leave free")
ap.add_argument("--flag", required=True, help="file written (free GiB) once the memory is held")
a = ap.parse_args()
free, _ = torch.cuda.mem_get_info()
hold = int(free - a.leave_gib * 2**30)
x = torch.empty(hold, dtype=torch.uint8, device="cuda") if hold > 0 else None
free, _ = torch.cuda.mem_get_info()
with open(a.flag, "w") as f:
    f.write(f"{free / 2**30:.2f}\n")
print(f"GPU ballast holds {max(hold, 0) / 2**30:.1f} GiB; free now {free / 2**30:.2f} GiB", flush=True)
while True:
    time.sleep(3600)
