"""Headless Chromium driven over the Chrome DevTools protocol, standard library only.

Chromium is started with `--remote-debugging-pipe`: it reads protocol messages (JSON, each ended by
a NUL byte) on file descriptor 3 and writes its answers and events on descriptor 4, so no port and
no websocket client are needed. A small trampoline puts the two pipe ends on 3 and 4 before it
executes Chromium.

    with Browser.launch() as browser:
        page = browser.new_page(1600, 1000)
        page.navigate("http://127.0.0.1:8188/")
        page.wait_for("window.app && window.app.graph")
        page.screenshot("shot.png")
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from tools.server_processes import child_setup

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
         "--remote-debugging-pipe")
# put the pipe ends on fds 3 and 4, then become Chromium
_TRAMPOLINE = ("import os, sys\n"
               "os.dup2(int(sys.argv[1]), 3)\n"
               "os.dup2(int(sys.argv[2]), 4)\n"
               "os.execv(sys.argv[3], sys.argv[3:])\n")


def find_chromium():
    """The Chromium binary: $CHROMIUM, else the first of CANDIDATES on PATH; None if there is none."""
    env = os.environ.get("CHROMIUM")
    if env:
        return shutil.which(env) or (env if os.access(env, os.X_OK) else None)
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class ProtocolError(RuntimeError):
    pass


class Browser:
    def __init__(self, proc, to_child, from_child, profile, log_path):
        self.proc, self._out, self._in, self.profile, self.log_path = proc, to_child, from_child, profile, log_path
        self._next_id = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._answers = {}
        self.events = []          # (method, params, sessionId) of every event, in order
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def launch(cls, binary=None, extra_flags=()):
        binary = binary or find_chromium()
        if not binary:
            raise FileNotFoundError("no Chromium found (set CHROMIUM or install chromium)")
        profile = tempfile.mkdtemp(prefix="zimage-chromium-")  # a new, empty profile every time
        log_path = os.path.join(profile, "chromium.log")
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        cmd = [sys.executable, "-c", _TRAMPOLINE, str(to_child_r), str(from_child_w), binary, *FLAGS,
               f"--user-data-dir={profile}", *extra_flags, "about:blank"]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    pass_fds=(to_child_r, from_child_w), preexec_fn=child_setup)
        os.close(to_child_r)
        os.close(from_child_w)
        browser = cls(proc, os.fdopen(to_child_w, "wb", buffering=0), os.fdopen(from_child_r, "rb", buffering=0),
                      profile, log_path)
        try:
            browser.send("Browser.getVersion", timeout=60)
        except BaseException:
            browser.close()
            raise
        return browser

    # -- protocol ------------------------------------------------------------------------------
    def _read(self):
        buf = b""
        while True:
            try:
                chunk = self._in.read(1 << 16)
            except (OSError, ValueError):
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._cond:
                    if "id" in msg:
                        self._answers[msg["id"]] = msg
                    else:
                        self.events.append((msg.get("method"), msg.get("params", {}), msg.get("sessionId")))
                    self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def send(self, method, params=None, session=None, timeout=60):
        """One protocol command; its result, or ProtocolError with the browser's message."""
        with self._lock:
            self._next_id += 1
            mid = self._next_id
            msg = {"id": mid, "method": method, "params": params or {}}
            if session:
                msg["sessionId"] = session
            self._out.write(json.dumps(msg).encode() + b"\0")
        end = time.monotonic() + timeout
        with self._cond:
            while mid not in self._answers:
                if self._closed:
                    raise ProtocolError(f"{method}: Chromium closed the pipe\n{self.log_tail()}")
                left = end - time.monotonic()
                if left <= 0:
                    raise ProtocolError(f"{method}: no answer within {timeout} s")
                self._cond.wait(left)
            answer = self._answers.pop(mid)
        if "error" in answer:
            raise ProtocolError(f"{method}: {answer['error'].get('message')} {answer['error'].get('data', '')}")
        return answer.get("result", {})

    def new_page(self, width=1600, height=1000):
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Page.enable")
        page.send("Runtime.enable")
        page.send("Network.enable")  # for responses()
        page.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        return page

    def log_tail(self, chars=3000):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def close(self):
        if self.proc.poll() is None:
            try:
                self.send("Browser.close", timeout=10)
            except (ProtocolError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        for f in (self._out, self._in):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Page:
    """One tab, attached with a flat session."""

    def __init__(self, browser, session):
        self.browser, self.session = browser, session

    def send(self, method, params=None, timeout=60):
        return self.browser.send(method, params, session=self.session, timeout=timeout)

    def navigate(self, url, timeout=60):
        self.send("Page.navigate", {"url": url}, timeout=timeout)

    def evaluate(self, expression, timeout=60):
        """The value of a JavaScript expression (promises awaited), or ProtocolError with the exception."""
        r = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True,
                                           "userGesture": True}, timeout=timeout)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            text = d.get("exception", {}).get("description") or d.get("text")
            raise ProtocolError(f"JavaScript error: {text}\n  in: {expression[:300]}")
        return r.get("result", {}).get("value")

    def wait_for(self, expression, timeout=60, poll=0.25):
        """Evaluate `expression` until it is truthy; its value. Fails after `timeout` seconds."""
        end = time.monotonic() + timeout
        last_error = None
        while time.monotonic() < end:
            try:
                value = self.evaluate(expression, timeout=max(5.0, end - time.monotonic()))
                if value:
                    return value
            except ProtocolError as e:
                last_error = e
            time.sleep(poll)
        raise TimeoutError(f"not true within {timeout} s: {expression[:300]}"
                           + (f"\n  last error: {last_error}" if last_error else ""))

    def click(self, x, y):
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left",
                                                   "clickCount": 0 if kind == "mouseMoved" else 1})

    def key(self, key, code=None, key_code=None):
        """Press and release one key (e.g. "Escape") on the focused element."""
        codes = {"Escape": 27, "Enter": 13, "Tab": 9}
        params = {"key": key, "code": code or key, "windowsVirtualKeyCode": key_code or codes.get(key, 0)}
        self.send("Input.dispatchKeyEvent", dict(params, type="keyDown"))
        self.send("Input.dispatchKeyEvent", dict(params, type="keyUp"))

    def screenshot(self, path, clip=None):
        """A PNG of the viewport (or of `clip`: x, y, width, height in CSS pixels) written to `path`."""
        params = {"format": "png"}
        if clip:
            params["clip"] = dict(zip(("x", "y", "width", "height"), clip), scale=1)
        data = self.send("Page.captureScreenshot", params)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    def responses(self):
        """(url, HTTP status) of every response this page received so far."""
        return [(params["response"]["url"], params["response"]["status"])
                for method, params, session in list(self.browser.events)
                if session == self.session and method == "Network.responseReceived"]

    def console_errors(self):
        """Console errors and uncaught exceptions this page reported so far (text)."""
        out = []
        for method, params, session in list(self.browser.events):
            if session != self.session:
                continue
            if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                d = params.get("exceptionDetails", {})
                out.append(d.get("exception", {}).get("description") or d.get("text", ""))
        return out
