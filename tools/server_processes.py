"""The processes of a server benchmark (``server_bench.py``): ComfyUI servers and ballasts started in
process groups of their own that die with the benchmark, their logs stamped with seconds, a small
client for the server's API and what its log says, the machine's RAM and a process's RSS. Standard
library only; Linux."""
import ctypes
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
PIN_RE = re.compile(r"Z-Image: pinned ([0-9.]+) GiB")
ZLOAD_RE = re.compile(r"Z-Image: loading the transformer")
# where an image's time goes (the pack's debug lines: --server-arg=--verbose --server-arg=DEBUG)
PHASES = {"encode_s": re.compile(r"Z-Image: prompt encoded in ([0-9.]+) s"),
          "decode_s": re.compile(r"Z-Image: decoded in ([0-9.]+) s"),
          "sample_s": re.compile(r"Z-Image: sampled \d+ steps in ([0-9.]+) s"),
          "first_step_s": re.compile(r"Z-Image: sampled .*the first ([0-9.]+) s"),
          "step_s": re.compile(r"Z-Image: sampled .* then ([0-9.]+) s a step"),
          "split_s": re.compile(r"Z-Image: split set in ([0-9.]+) s")}
# the split's simulated step (the planner's bound for it), the last one set for the image
BOUND_RE = re.compile(r"Z-Image: split set in .*; its simulated step ([0-9.]+) s")
# layer uploads of the sample that read the checkpoint rather than a master (layers coming back from the page cache)
FILE_RE = re.compile(r"Z-Image: sampled .*; (\d+) layer uploads read the checkpoint")
EVICT_RE = re.compile(r"Z-Image: made room for another model: ([0-9.]+) GiB freed")
# the stamps of the decode's end and of the prompt's: what comes after the decode is ComfyUI's
# SaveImage writing the PNG (slow for a random-weight image, which looks like noise) and the pack
# setting its split back, which neither the floor nor the pack's phases count
DECODED_AT = re.compile(r"^ *([0-9.]+) .*Z-Image: decoded in", re.M)
DONE_AT = re.compile(r"^ *([0-9.]+) .*Prompt executed in", re.M)
COMFY_LOADS = {"requested": "Requested to load", "completely": "loaded completely", "partially": "loaded partially"}
GIB = 2**30


def mem_available_gib():
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) * 1024 / GIB for l in f if l.startswith("MemAvailable:"))


def rss_gib(pid):
    """RssAnon and RssFile of one process: main.py runs the whole server in one process."""
    with open(f"/proc/{pid}/status") as f:
        kb = {l.split(":")[0]: int(l.split()[1]) for l in f if l.startswith(("RssAnon", "RssFile"))}
    return kb["RssAnon"] * 1024 / GIB, kb["RssFile"] * 1024 / GIB


# looked up here, not in the forked child, where loading a library could wait on a lock another
# thread of the parent held at the fork
_LIBC = ctypes.CDLL(None, use_errno=True)


def child_setup():
    """A child's ``preexec_fn``: a process group of its own, so stop() ends it and anything it
    started with one signal (the same session, so whatever ends this session's processes ends
    these too), and SIGKILL when the thread that started it dies, however it dies: a server, a
    ballast or a browser left behind holds GBs of RAM or GPU memory that the next run misses."""
    os.setpgid(0, 0)
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(cmd, log_path, env=None, cwd=None):
    """Start ``cmd`` with its output in ``log_path``, each line stamped with the seconds since the
    start (ComfyUI's own lines carry no time: the stamps show where an image's seconds went)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            preexec_fn=child_setup)
    threading.Thread(target=_stamp, args=(proc.stdout, log_path, time.monotonic()), daemon=True).start()
    return proc


def _stamp(out, log_path, start):
    with out, open(log_path, "ab", buffering=0) as log:
        for line in out:
            log.write(b"%9.3f " % (time.monotonic() - start) + line)


def stop(proc):
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


def tail(path, n=40):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def start_ballast(a, script, leave_gib, flag, log, timeout=600, env=None):
    """Start tools/<script> holding all but leave_gib, and wait for its flag file (memory held)."""
    proc = spawn([a.python, os.path.join(HERE, script), "--leave-gib", str(leave_gib), "--flag", flag], log, env=env)
    end = time.monotonic() + timeout
    while not os.path.exists(flag):
        if proc.poll() is not None or time.monotonic() > end:
            stop(proc)
            raise SystemExit(f"{script} exited with {proc.returncode} or was not ready in {timeout} s:\n{tail(log)}")
        time.sleep(0.5)
    return proc


class Server:
    def __init__(self, proc, port, log):
        self.proc, self.url, self.log, self.offset = proc, f"http://127.0.0.1:{port}", log, 0

    def call(self, path, body=None, timeout=60):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SystemExit(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:4000]}") from None
        except OSError:
            self.check_alive()  # a dead server says why in its log; otherwise the caller decides
            raise

    def check_alive(self):
        if self.proc.poll() is not None:
            raise SystemExit(f"ComfyUI exited with {self.proc.returncode}; log {self.log}:\n{tail(self.log)}")

    def wait_ready(self, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.check_alive()
            try:
                return self.call("/system_stats", timeout=5)
            except (OSError, ValueError):  # not listening yet
                time.sleep(1)
        raise SystemExit(f"ComfyUI did not answer within {timeout} s; log {self.log}:\n{tail(self.log)}")

    def run(self, workflow, timeout):
        """Queue one prompt and wait; the executor's own seconds from start to success."""
        resp = self.call("/prompt", {"prompt": workflow, "client_id": uuid.uuid4().hex})
        if resp.get("node_errors") or "prompt_id" not in resp:
            raise SystemExit(f"ComfyUI rejected the prompt: {json.dumps(resp, indent=1)[:4000]}")
        pid, end = resp["prompt_id"], time.monotonic() + timeout
        while True:
            status = (self.call(f"/history/{pid}").get(pid) or {}).get("status", {})
            events = {name: data for name, data in status.get("messages", [])}
            if status.get("status_str") == "error" or "execution_error" in events:
                e = events.get("execution_error", {})
                raise SystemExit(f"the prompt failed in {e.get('node_type')} (node {e.get('node_id')}): "
                                 f"{e.get('exception_type')}: {e.get('exception_message')}\n"
                                 f"{''.join(e.get('traceback', []))[-3000:]}log: {self.log}")
            if status.get("status_str") == "success":
                self._wait_done(2.0)
                return (events["execution_success"]["timestamp"] - events["execution_start"]["timestamp"]) / 1000
            self.check_alive()
            if time.monotonic() > end:
                raise SystemExit(f"the prompt did not finish within {timeout} s; log {self.log}")
            time.sleep(0.2)

    def _wait_done(self, seconds):
        """ComfyUI records a prompt's success before it logs "Prompt executed" (``DONE_AT``): wait
        for the line, so that ``new_log`` reads it with the image it belongs to."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                if DONE_AT.search(f.read().decode(errors="replace")):
                    return
            time.sleep(0.01)

    def new_log(self):
        """Counts of the pack's and ComfyUI's load lines in the log since the last call."""
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            raw = f.read()
        self.offset += len(raw)
        text = raw.decode(errors="replace")
        pins = [float(g) for g in PIN_RE.findall(text)]
        out = dict(pin_calls=len(pins), pinned_gib=sum(pins), zimage_loads=len(ZLOAD_RE.findall(text)),
                   evicted_gib=round(sum(float(g) for g in EVICT_RE.findall(text)), 2))
        out.update({k: round(sum(float(g) for g in r.findall(text)), 3) for k, r in PHASES.items() if r.search(text)})
        if FILE_RE.search(text):
            out["file_uploads"] = sum(int(g) for g in FILE_RE.findall(text))
        out.update({f"comfy_{k}": text.count(v) for k, v in COMFY_LOADS.items()})
        decoded = list(DECODED_AT.finditer(text))
        # the line after this image's decode (one left over from a slow log would come before it)
        done = DONE_AT.search(text, decoded[-1].end()) if decoded else None
        if done:
            out["after_decode_s"] = round(float(done.group(1)) - float(decoded[-1].group(1)), 3)
        bounds = BOUND_RE.findall(text)
        if bounds:
            out["step_bound_s"] = float(bounds[-1])
        return out


def read_through(paths):
    """Read each file once before the ballasts start, so that every server starts with the weights
    in the page cache as far as the simulated RAM holds them (a user's machine after an earlier
    run), not with what the server before it happened to leave there. Dirty pages are written out
    first (weights written just before): the RAM ballast cannot reclaim them, so the kernel would
    drop the clean pages just read instead, and the first image would read the disk."""
    os.sync()
    buf = bytearray(64 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
