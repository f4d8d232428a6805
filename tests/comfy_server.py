"""A real ComfyUI server for the tests: a base directory with this pack in `custom_nodes/`, small
random weights in `models/`, `main.py --cpu` on a free port, and a small HTTP client.

The fixtures are registered in tests/conftest.py, so every test module shares one server per
session (a server with ComfyUI's full-size text encoder holds several GB):

    @needs_comfyui
    def test_something(comfy_server):
        pid, _ = comfy_server.post(prompt)
        entry = comfy_server.wait(pid, 300)

Weights (random values, real key layouts, cached under the system temp dir between sessions):
- `diffusion_models/z_image_turbo_bf16.safetensors`: dim 3840 with ONE main layer, written by
  `tools.random_weights` (ComfyUI detects it as Z-Image).
- `text_encoders/qwen_3_4b.safetensors` (Qwen3-4B, 2 of 36 layers) and `vae/ae.safetensors` (Flux
  AE): written by `comfy_te_vae_weights.py` from ComfyUI's own classes.

ComfyUI builds all 36 Qwen3-4B layers whatever the file holds, and leaves the 34 missing ones
uninitialized (`torch.empty`): the conditioning is NaN or garbage. The server therefore runs with
`MALLOC_PERTURB_=255` (glibc fills every fresh allocation with zero bytes, large ones are fresh
zero pages anyway), so the missing layers are zeros: residual blocks that pass their input
through, and the text encoder is deterministic and finite.

Extra server flags: `COMFY_SERVER_FLAGS` (e.g. `--disable-dynamic-vram`), or `start_server(flags=...)`.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shlex
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pytest

from comfy_env import COMFYUI_PATH, comfyui_version
from tools.server_processes import child_setup

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PACK = "zimage_turbo_streaming"
UNET = "z_image_turbo_bf16.safetensors"
TE = "qwen_3_4b.safetensors"
VAE = "ae.safetensors"
TE_LAYERS = 2
TE_LAYERS_FULL = 36  # Qwen3-4B whole (8 GB): for the GPU test, where ComfyUI's Dynamic VRAM needs every weight
START_TIMEOUT = 120


def _digest(*paths):
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


@contextlib.contextmanager
def _locked(folder):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cache_root():
    return os.path.join(tempfile.gettempdir(), "zimage_comfy_test_weights")


def transformer_weights(full=False):
    """The dim-3840 transformer (ComfyUI key layout), cached by the writer's source: one main layer,
    or with ``full`` all 30 (12 GB, trained-like scales, drawn on the GPU where there is one)."""
    import torch

    key = _digest(*(os.path.join(ROOT, f) for f in ("tools/random_weights.py", "zimage_core/checkpoint.py",
                                                     "zimage_core/config.py", "tests/comfy_server.py")))
    folder = os.path.join(cache_root(), f"transformer-{key}{'-full' if full else ''}")
    path = os.path.join(folder, UNET)
    with _locked(folder):
        if not os.path.isfile(path):
            from zimage_core.config import ZImageConfig
            from tools.random_weights import write_checkpoint

            tmp = os.path.join(folder, f"tmp-{os.getpid()}.safetensors")
            if full:
                write_checkpoint(tmp, ZImageConfig(), dtype=torch.bfloat16,
                                 device="cuda" if torch.cuda.is_available() else "cpu")
            else:
                # plain N(0, 0.02) values: with the realistic scales' small output projections one layer
                # barely moves the noise, and the sensitivity test needs the transformer to shape the image
                write_checkpoint(tmp, ZImageConfig(n_layers=1), dtype=torch.bfloat16, realistic=False)
            os.replace(tmp, path)
    return path


@contextlib.contextmanager
def model_file(client, base_dir, name, write):
    """``models/diffusion_models/<name>`` written by ``write(path)`` for the block's duration, then
    removed and ComfyUI told to let go of it (a file it still maps keeps its disk): the derived
    transformers (GGUF, scaled fp8, a dequantized reference) take a gigabyte or more each, written
    in seconds, and a CI machine's disk may hold only a few of them at once."""
    path = os.path.join(base_dir, "models", "diffusion_models", name)
    write(path)
    try:
        yield name
    finally:
        os.remove(path)
        status, raw, _ = client.request("POST", "/free", {"unload_models": True, "free_memory": True})
        assert status == 200, raw


def te_vae_weights(python=None, comfy_path=None, te_layers=TE_LAYERS):
    """Qwen3-4B (its first `te_layers` layers) and the Flux AE from ComfyUI's own classes, cached per
    ComfyUI version. The random numbers are drawn on the GPU where there is one (the full text
    encoder is 4 billion of them)."""
    comfy_path = comfy_path or COMFYUI_PATH
    script = os.path.join(HERE, "comfy_te_vae_weights.py")
    folder = os.path.join(cache_root(), f"comfyui-{comfyui_version()}-{_digest(script)}-l{te_layers}")
    paths = {n: os.path.join(folder, n) for n in (TE, VAE)}
    with _locked(folder):
        if not all(os.path.isfile(p) for p in paths.values()):
            import torch

            device = ["--device", "cuda"] if te_layers > TE_LAYERS and torch.cuda.is_available() else []
            r = subprocess.run([python or sys.executable, script, comfy_path, folder, "--te-layers", str(te_layers),
                                *device], capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, f"weight generator failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return paths


def put_nan(path, key):
    """Set the middle value of ``key`` (bf16) in the safetensors file at ``path`` to NaN, in place."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(n))[key]
        assert entry["dtype"] == "BF16"
        start, stop = entry["data_offsets"]
        f.seek(8 + n + start + (stop - start) // 4 * 2)
        f.write(b"\xc0\x7f")


def sparse_twin(src, dst):
    """A file with ``src``'s safetensors header and zeros for every tensor, written as a hole (it
    takes no disk): for the tests that damage a model file. Full copies took 3.4 GB, more than a CI
    machine's disk may have free."""
    with open(src, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = f.read(n)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", n) + head)
    os.truncate(dst, os.path.getsize(src))


def make_base_dir(base, te_layers=TE_LAYERS, full_transformer=False):
    """custom_nodes/<pack> -> repository root; models/{diffusion_models,text_encoders,vae,loras}; user,
    input, output, frontend."""
    for sub in ("custom_nodes", "models/diffusion_models", "models/text_encoders", "models/vae", "models/loras",
                "user", "input", "output", "frontend"):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
    link = os.path.join(base, "custom_nodes", PACK)
    if not os.path.islink(link):
        os.symlink(ROOT, link, target_is_directory=True)
    te_vae = te_vae_weights(te_layers=te_layers)
    for folder, name, src in (("diffusion_models", UNET, transformer_weights(full_transformer)), ("text_encoders", TE, te_vae[TE]),
                              ("vae", VAE, te_vae[VAE])):
        dst = os.path.join(base, "models", folder, name)
        if not os.path.lexists(dst):
            os.symlink(src, dst)
    return base


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyClient:
    """HTTP client for one running server. `post` -> `wait` -> `image` is the usual path."""

    def __init__(self, proc, port, base_dir, log_path, flags):
        self.proc, self.port, self.base_dir, self.log_path, self.flags = proc, port, base_dir, log_path, flags
        self.url = f"http://127.0.0.1:{port}"
        self.client_id = uuid.uuid4().hex

    # -- raw HTTP ------------------------------------------------------------------------------
    def request(self, method, path, body=None, timeout=60):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers.get("Content-Type", "")

    def get(self, path, timeout=60):
        """GET `path`; JSON answers decoded, anything else as bytes. Asserts HTTP 200."""
        status, raw, ctype = self.request("GET", path, timeout=timeout)
        assert status == 200, f"GET {path}: HTTP {status}: {raw[:500]!r}"
        return json.loads(raw) if "json" in ctype else raw

    # -- prompts -------------------------------------------------------------------------------
    def post(self, prompt, check=True):
        """POST /prompt. Returns (prompt_id, response json); with `check`, asserts HTTP 200 and no node_errors."""
        status, raw, _ = self.request("POST", "/prompt", {"prompt": prompt, "client_id": self.client_id})
        resp = json.loads(raw) if raw else {}
        if check:
            assert status == 200, f"POST /prompt: HTTP {status}: {json.dumps(resp)[:3000]}"
            assert not resp.get("node_errors"), f"node_errors: {json.dumps(resp['node_errors'])[:3000]}"
        else:
            resp["_http_status"] = status
        return resp.get("prompt_id"), resp

    def history(self, prompt_id):
        return self.get(f"/history/{prompt_id}").get(prompt_id)

    def wait(self, prompt_id, timeout=600, poll=0.5):
        """Poll /history/<id> until the prompt finished (success, error or interrupted); the history entry."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            entry = self.history(prompt_id)
            if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
                return entry
            if self.proc.poll() is not None:
                pytest.fail(f"ComfyUI exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(poll)
        pytest.fail(f"prompt {prompt_id} not finished after {timeout} s:\n{self.log_tail()}")

    def run(self, prompt, timeout=600):
        """post + wait; asserts success; returns the history entry."""
        pid, _ = self.post(prompt)
        entry = self.wait(pid, timeout)
        assert entry["status"]["status_str"] == "success", \
            f"{json.dumps(entry['status'])[:4000]}\n--- server log ---\n{self.log_tail()}"
        return entry

    def interrupt(self):
        status, raw, _ = self.request("POST", "/interrupt", {})
        assert status == 200, f"POST /interrupt: HTTP {status} {raw[:300]!r}"

    def queue(self):
        return self.get("/queue")

    # -- results -------------------------------------------------------------------------------
    def image_refs(self, entry, node_id):
        return entry["outputs"][str(node_id)]["images"]

    def image_bytes(self, ref):
        q = urllib.parse.urlencode({"filename": ref["filename"], "subfolder": ref.get("subfolder", ""),
                                    "type": ref.get("type", "output")})
        return self.get(f"/view?{q}")

    def image(self, entry, node_id, index=0):
        """The index-th image saved by node `node_id`, as a PIL image (fetched through /view)."""
        from PIL import Image

        img = Image.open(io.BytesIO(self.image_bytes(self.image_refs(entry, node_id)[index])))
        img.load()
        return img

    # -- log -------------------------------------------------------------------------------------
    def log_text(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, chars=6000):
        return self.log_text()[-chars:]


def start_server(base_dir, flags=(), python=None, timeout=START_TIMEOUT, log_name=None, env=None, cpu=True,
                 frontend=False):
    """Start `main.py --cpu` (without ``cpu``: on the GPU) on a free port with `base_dir` (and
    ``env`` on top of this process's environment); returns a ComfyClient once /object_info answers.
    Without ``frontend`` the web root is an empty folder: API prompts need no frontend package."""
    port = free_port()
    log_path = os.path.join(base_dir, log_name or f"comfyui-{port}.log")
    cmd = [python or sys.executable, "main.py", *(["--cpu"] if cpu else []), "--listen", "127.0.0.1", "--port", str(port),
           "--disable-auto-launch", "--base-directory", base_dir,
           "--database-url", f"sqlite:///{os.path.join(base_dir, 'user', 'comfyui.db')}",
           *([] if frontend else ["--front-end-root", os.path.join(base_dir, "frontend")]), *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MALLOC_PERTURB_="255", **(env or {}))
    log = open(log_path, "w")
    log.write(f"$ cd {COMFYUI_PATH} && {shlex.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=COMFYUI_PATH, stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=child_setup)  # it dies with the tests, even killed ones
    log.close()
    client = ComfyClient(proc, port, base_dir, log_path, list(flags))
    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with {proc.returncode} while starting:\n{client.log_tail()}")
        try:
            status, _, _ = client.request("GET", "/object_info", timeout=30)
            if status == 200:
                return client
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > end:
            stop_server(client)
            raise RuntimeError(f"ComfyUI did not answer /object_info within {timeout} s:\n{client.log_tail()}")
        time.sleep(0.5)


def stop_server(client):
    proc = client.proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


# ComfyUI's RAM-pressure cache (v0.28) keeps this much RAM available (GB), here set explicitly: the
# pack's host budget must read it from ComfyUI and keep it free
CACHE_RAM_HEADROOM = 3.0


def has_cache_ram() -> bool:
    """The RAM-pressure cache is ComfyUI's default (v0.28: an active and an inactive headroom). Older
    trees have --cache-ram as an option; there it would keep every old output until RAM runs low,
    which the other tests, each loading its own models, do not expect."""
    with open(os.path.join(COMFYUI_PATH, "main.py")) as f:
        return "cache_ram_inactive" in f.read()


def server_flags():
    flags = shlex.split(os.environ.get("COMFY_SERVER_FLAGS", ""))
    if has_cache_ram() and "--cache-ram" not in flags:
        flags += ["--cache-ram", str(CACHE_RAM_HEADROOM)]
    return flags


@pytest.fixture(scope="session")
def comfy_base_dir(tmp_path_factory):
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI source tree (v0.8.0, v0.20.1, v0.28.0 or v0.33.0) to run the ComfyUI tests")
    return make_base_dir(str(tmp_path_factory.mktemp("comfy_base")))


@pytest.fixture(scope="session")
def comfy_server(comfy_base_dir):
    """One ComfyUI server for the session (flags from COMFY_SERVER_FLAGS)."""
    t0 = time.monotonic()
    client = start_server(comfy_base_dir, server_flags(), log_name="comfyui.log")
    print(f"\nComfyUI {comfyui_version()} ready in {time.monotonic() - t0:.1f} s on port {client.port} "
          f"(flags {client.flags}); log {client.log_path}")
    yield client
    stop_server(client)
