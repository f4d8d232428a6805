#!/usr/bin/env python3
"""Run the Z-Image-Turbo API workflow on a ComfyUI server and save the images (standard library only).

    python run.py --server http://127.0.0.1:8188 --out images/ --prompt "a red fox in snow" --seed 7

Start ComfyUI headless first (e.g. `python main.py --listen 127.0.0.1 --port 8188`) with this pack in
custom_nodes/ and the models in place. The workflow defaults to z_image_turbo.json beside this
script; --workflow takes any API-format export (Workflow > Export (API)).
"""
import argparse
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT_NODES = ("ZImageTextEncode", "CLIPTextEncode")
SAMPLER_NODES = ("ZImageSampler", "KSampler")
SIZE_NODES = ("ZImageSampler", "EmptySD3LatentImage", "EmptyLatentImage")


def call(server, path, body=None, timeout=60):
    """The body of the server's answer; any failure ends the script with one line."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.rstrip("/") + path, data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        try:
            detail = e.read().decode(errors="replace")
        except (OSError, http.client.HTTPException):
            detail = ""
        raise SystemExit(f"{req.get_method()} {path}: HTTP {e.code}: {detail[:4000]}") from None
    except urllib.error.URLError as e:
        raise SystemExit(f"cannot reach ComfyUI at {server}: {e.reason}. Is the server running?") from None
    except (OSError, http.client.HTTPException) as e:
        # the server closed or reset the connection, or stopped answering: it died or was stopped mid-run
        raise SystemExit(f"lost the connection to ComfyUI at {server} during {req.get_method()} {path}: "
                         f"{e or type(e).__name__}. Did the server stop? Its console says why.") from None


def call_json(server, path, body=None):
    raw = call(server, path, body)
    try:
        return json.loads(raw)
    except ValueError:
        raise SystemExit(f"{server}{path} answered something that is not JSON ({raw[:80]!r}): "
                         "is this a ComfyUI server?") from None


def nodes_of(workflow, class_types):
    return [n for n in workflow.values() if isinstance(n, dict) and n.get("class_type") in class_types]


def apply_overrides(workflow, prompt=None, seed=None, width=None, height=None, steps=None):
    def put(class_types, name, value):
        if value is None:
            return
        targets = [n for n in nodes_of(workflow, class_types) if name in n["inputs"]]
        if not targets:
            raise SystemExit(f"the workflow has no {'/'.join(class_types)} node with an input {name!r}")
        for n in targets:
            n["inputs"][name] = value

    if prompt is not None:
        # the positive prompt: text encoders whose text is not linked from another node
        texts = [n for n in nodes_of(workflow, TEXT_NODES) if isinstance(n["inputs"].get("text"), str)]
        if not texts:
            raise SystemExit("the workflow has no text encode node to put the prompt in")
        texts[0]["inputs"]["text"] = prompt
    put(SAMPLER_NODES, "seed", seed)
    put(SAMPLER_NODES, "steps", steps)
    put(SIZE_NODES, "width", width)
    put(SIZE_NODES, "height", height)
    return workflow


def error_text(status):
    for event, data in status.get("messages", []):
        if event == "execution_error":
            return (f"{data.get('node_type')} (node {data.get('node_id')}) failed: "
                    f"{data.get('exception_type')}: {data.get('exception_message')}")
        if event == "execution_interrupted":
            return f"interrupted at {data.get('node_type')} (node {data.get('node_id')})"
    return json.dumps(status)[:2000]


def run(server, workflow, out_dir, timeout=3600, poll=1.0, quiet=False):
    """Queue `workflow`, wait for it and download its images into `out_dir`; the saved paths."""
    resp = call_json(server, "/prompt", {"prompt": workflow, "client_id": uuid.uuid4().hex})
    if resp.get("node_errors"):
        raise SystemExit(f"ComfyUI rejected the workflow: {json.dumps(resp['node_errors'], indent=1)[:4000]}")
    prompt_id = resp.get("prompt_id")
    if prompt_id is None:
        raise SystemExit(f"ComfyUI queued nothing: {json.dumps(resp)[:2000]}")
    if not quiet:
        print(f"queued {prompt_id}", flush=True)
    end = time.monotonic() + timeout
    while True:
        entry = call_json(server, f"/history/{prompt_id}").get(prompt_id)
        status = (entry or {}).get("status", {})
        if status.get("status_str") == "success" or status.get("completed"):
            break
        if status.get("status_str") == "error":
            raise SystemExit(f"the prompt failed: {error_text(status)}")
        if time.monotonic() > end:
            raise SystemExit(f"the prompt did not finish within {timeout} s")
        time.sleep(poll)
    os.makedirs(out_dir, exist_ok=True)
    saved = []
    for node_id, output in sorted(entry.get("outputs", {}).items()):
        for img in output.get("images", []):
            if img.get("type", "output") != "output":
                continue  # previews
            q = urllib.parse.urlencode({"filename": img["filename"], "subfolder": img.get("subfolder", ""),
                                        "type": img.get("type", "output")})
            path = os.path.join(out_dir, os.path.basename(img["filename"]))
            with open(path, "wb") as f:
                f.write(call(server, f"/view?{q}"))
            saved.append(path)
            if not quiet:
                print(path, flush=True)
    if not saved:
        raise SystemExit("the prompt finished but saved no image (is there a SaveImage node?)")
    return saved


def check_out_dir(path):
    """Say before the prompt runs, not after it, when the images could not be saved."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise SystemExit(f"cannot save the images in {path}: {probe} is not a folder this user can write to")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default="http://127.0.0.1:8188", help="ComfyUI's address (default %(default)s)")
    ap.add_argument("--workflow", default=os.path.join(HERE, "z_image_turbo.json"),
                    help="an API-format workflow (default: z_image_turbo.json beside this script)")
    ap.add_argument("--out", default="zimage_out", help="folder for the images (created)")
    ap.add_argument("--prompt", help="the positive prompt (default: the workflow's)")
    ap.add_argument("--seed", type=int, help="the sampler's seed (default: the workflow's)")
    ap.add_argument("--width", type=int, help="image width in pixels, a multiple of 16 (default: the workflow's)")
    ap.add_argument("--height", type=int, help="image height in pixels, a multiple of 16 (default: the workflow's)")
    ap.add_argument("--steps", type=int, help="sampling steps (default: the workflow's; Z-Image-Turbo uses 8)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds to wait for the prompt")
    a = ap.parse_args(argv)
    try:
        with open(a.workflow) as f:
            workflow = json.load(f)
    except OSError as e:
        raise SystemExit(f"cannot read the workflow {a.workflow}: {e.strerror}") from None
    except ValueError as e:
        raise SystemExit(f"{a.workflow} is not JSON ({e}): export it with Workflow > Export (API)") from None
    if not isinstance(workflow, dict):
        raise SystemExit(f"{a.workflow} is not an API-format workflow: export it with Workflow > Export (API)")
    if isinstance(workflow.get("nodes"), list):  # what Workflow > Save and Export write
        raise SystemExit(f"{a.workflow} is a UI workflow (the graph as the editor saves it): in ComfyUI, "
                         "open it and use Workflow > Export (API), then pass that file")
    check_out_dir(a.out)
    apply_overrides(workflow, a.prompt, a.seed, a.width, a.height, a.steps)
    try:
        run(a.server, workflow, a.out, timeout=a.timeout)
    except KeyboardInterrupt:
        raise SystemExit("stopped waiting; the prompt may still run on the server (POST /interrupt stops it)") from None
    except OSError as e:  # the server's errors are handled in call(): this is the output folder
        raise SystemExit(f"cannot save the images in {a.out}: {e}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
