"""The UI workflows in ComfyUI's real frontend, in headless Chromium, as a user meets them.

A real ComfyUI server (`comfy_server.py`: this pack in `custom_nodes/`, small random weights,
`--cpu`) serves the frontend from ComfyUI's `comfyui-frontend-package`; Chromium is driven over the
DevTools protocol (`browser.py`, standard library only). Checked:

- the template browser lists both workflows under the pack and shows each one's thumbnail
  (`workflows/<name>.jpg`, served at `/api/workflow_templates/<pack>/<name>.jpg`);
- picking a card loads the workflow with every node known to the frontend and no missing-nodes
  warning (a workflow with an unknown node is flagged, so the check can fail);
- the pack's four nodes are the pack's (their definitions come from its Python module), carry
  their inputs as widgets and are drawn: the picture changes when the node is moved away.

Runs where COMFYUI_PATH points at a ComfyUI tree, pytest runs in a Python with ComfyUI's
requirements and its frontend package, and Chromium is installed (Debian: `apt-get install
chromium`; or CHROMIUM=/path/to/chrome). Skips with the reason elsewhere. Screenshots are left in
the test's temporary folder (printed with `-s`).

Make the thumbnails again after changing a workflow (from the repository root):

    COMFYUI_PATH=/path/to/ComfyUI /path/to/comfy-venv/bin/python tests/test_frontend.py --thumbnails
"""
import base64
import importlib.util
import json
import os
import sys
import time
import urllib.parse

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

from browser import Browser, find_chromium  # noqa: E402
from comfy_env import COMFYUI_PATH, comfyui_version  # noqa: E402
from comfy_server import PACK, make_base_dir, start_server, stop_server  # noqa: E402

WORKFLOWS = os.path.join(ROOT, "workflows")
UI_WORKFLOWS = ("z_image_turbo", "z_image_turbo_stock_nodes")
PACK_NODES = ("ZImageModelLoader", "ZImageTextEncode", "ZImageSampler", "ZImageDecode")
VIEW = (1800, 1000)
# What each thumbnail says (the template browser itself shows only the file name)
THUMBNAIL_TEXT = {
    "z_image_turbo": ("Z-Image-Turbo", "streaming",
                      "Text to image on 6-12 GB cards: the pack's loader, text encode, sampler and decode"),
    "z_image_turbo_stock_nodes": ("Z-Image-Turbo", "streaming loader + stock nodes",
                                  "The pack's loader with ComfyUI's own KSampler and VAEDecode"),
}
THUMBNAIL_SIZE = 768
CLEAN_CANVAS = {"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False, "Comfy.Graph.CanvasMenu": False,
                "Comfy.Graph.CanvasInfo": False, "Comfy.NodeBadge.NodeSourceBadgeMode": "None",
                "Comfy.NodeBadge.NodeIdBadgeMode": "None"}


def skip_reason():
    if not COMFYUI_PATH or not os.path.isfile(os.path.join(COMFYUI_PATH, "main.py")):
        return "set COMFYUI_PATH to a ComfyUI source tree to run the frontend tests"
    if importlib.util.find_spec("comfyui_frontend_package") is None:
        return ("ComfyUI's frontend is not installed in this Python (pip install comfyui-frontend-package, "
                "the version in ComfyUI's requirements.txt)")
    if find_chromium() is None:
        return "no Chromium found (Debian: apt-get install chromium; or set CHROMIUM to a Chrome binary)"
    return None


pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


def load_ui(name):
    with open(os.path.join(WORKFLOWS, f"{name}.json")) as f:
        return json.load(f)


def thumbnail_url(name):
    return f"/api/workflow_templates/{urllib.parse.quote(PACK)}/{name}.jpg"


def jpeg_size(data):
    """(width, height) from a JPEG's start-of-frame marker."""
    assert data[:2] == b"\xff\xd8", "not a JPEG"
    i = 2
    while i < len(data):
        marker, length = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        if marker in (0xC0, 0xC1, 0xC2):
            return int.from_bytes(data[i + 7:i + 9], "big"), int.from_bytes(data[i + 5:i + 7], "big")
        i += 2 + length
    raise AssertionError("no JPEG frame header")


# -- the frontend, as a user drives it --------------------------------------------------------------

NAV_ITEM = """(() => Array.from(document.querySelectorAll('[role=dialog] *'))
    .find(e => e.children.length == 0 && e.textContent.trim() == %s))()""" % json.dumps(PACK)

GRAPH_NODES = """window.app.graph._nodes.map(n => ({
    id: n.id, type: n.type, title: n.title,
    registered: n.type in LiteGraph.registered_node_types,
    has_errors: !!n.has_errors,
    module: (n.constructor.nodeData || {}).python_module || null,
    widgets: (n.widgets || []).map(w => w.name),
    inputs: (n.inputs || []).map(i => i.name),
    size: Array.from(n.size)}))"""

# a dialog the frontend opens on loading a graph with unknown node types ("Some Nodes Are Missing")
MISSING_DIALOG = """Array.from(document.querySelectorAll('[role=dialog]'))
    .map(d => d.innerText).filter(t => /missing/i.test(t))"""


def open_app(page, url):
    page.navigate(url + "/")
    page.wait_for("!!(window.app && window.app.graph && window.app.canvas && window.LiteGraph)", timeout=120)
    # node definitions come from /object_info: wait until the pack's are registered
    page.wait_for("%s.every(t => t in LiteGraph.registered_node_types)" % json.dumps(PACK_NODES), timeout=60)


def open_templates(page):
    """The template browser, on the pack's own category; returns when its cards are there."""
    try:  # the frontend opens it by itself on a first start
        page.wait_for("!!" + NAV_ITEM, timeout=10)
    except TimeoutError:
        page.evaluate("window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
        page.wait_for("!!" + NAV_ITEM, timeout=60)
    page.evaluate(NAV_ITEM + ".click()")
    for name in UI_WORKFLOWS:
        page.wait_for(f"!!document.querySelector('[data-testid=\"template-workflow-{name}\"]')", timeout=30)


def close_dialogs(page):
    """Close every open dialog with its close button (an "x"), or else with Escape."""
    for _ in range(5):
        if not page.evaluate("document.querySelectorAll('[role=dialog]').length"):
            return
        clicked = page.evaluate("""(() => { let n = 0; for (const d of document.querySelectorAll('[role=dialog]')) {
            const b = Array.from(d.querySelectorAll('button')).find(b =>
                /close/i.test(b.getAttribute('aria-label') || '') ||
                b.querySelector('.pi-times, [class*="lucide--x"]:not([class*="lucide--x-"])'));
            if (b) { b.click(); n++; } } return n; })()""")
        if not clicked:
            page.key("Escape")
        time.sleep(0.5)
    page.wait_for("document.querySelectorAll('[role=dialog]').length == 0", timeout=10)


def card_state(page, name):
    return page.evaluate("""(() => { const c = document.querySelector('[data-testid="template-workflow-%s"]');
        if (!c) return null;
        return {text: c.innerText,
                images: Array.from(c.querySelectorAll('img')).map(i => ({
                    src: i.currentSrc || i.src, complete: i.complete, width: i.naturalWidth,
                    height: i.naturalHeight}))}; })()""" % name)


def load_from_template(page, name):
    """Pick the workflow's card in the template browser; the graph's nodes once it has loaded."""
    open_templates(page)
    page.evaluate(f"document.querySelector('[data-testid=\"template-workflow-{name}\"]').click()")
    want = len(load_ui(name)["nodes"])
    page.wait_for(f"window.app.graph._nodes.length == {want} && "
                  f"window.app.graph._nodes.some(n => n.type == {json.dumps(load_ui(name)['nodes'][0]['type'])})",
                  timeout=60)
    time.sleep(1.0)  # a frame or two, and any dialog the load opens
    return page.evaluate(GRAPH_NODES)


def fit_graph(page, x0, y0, width, height, margin=20):
    """Scale and move the canvas so that every node lies inside the screen rectangle given; the
    screen rectangle the graph (with its margin) then takes."""
    rect = page.evaluate(f"""(() => {{
      const T = LiteGraph.NODE_TITLE_HEIGHT; let a = 1e9, b = 1e9, c = -1e9, d = -1e9;
      const boxes = window.app.graph._nodes.map(n => [n.pos[0], n.pos[1] - T, n.size[0], n.size[1] + T])
        .concat((window.app.graph._groups || []).map(g => Array.from(g._bounding || g.bounding || [])));
      for (const [x, y, w, h] of boxes) {{ a = Math.min(a, x); b = Math.min(b, y);
        c = Math.max(c, x + w); d = Math.max(d, y + h); }}
      const s = Math.min({width} / (c - a + 2 * {margin}), {height} / (d - b + 2 * {margin}));
      const ds = window.app.canvas.ds; ds.scale = s;
      ds.offset[0] = {x0} / s - a + {margin} + ({width} / s - (c - a + 2 * {margin})) / 2;
      ds.offset[1] = {y0} / s - b + {margin};
      window.app.canvas.setDirty(true, true); window.app.canvas.draw(true, true);
      const r = window.app.canvas.canvas.getBoundingClientRect();
      return [r.left + (a - {margin} + ds.offset[0]) * s, r.top + (b - {margin} + ds.offset[1]) * s,
              (c - a + 2 * {margin}) * s, (d - b + 2 * {margin}) * s]; }})()""")
    time.sleep(0.5)
    return rect


def node_screen_rect(page, node_id):
    return page.evaluate(f"""(() => {{ const n = window.app.graph.getNodeById({node_id}); const ds = window.app.canvas.ds;
        const T = LiteGraph.NODE_TITLE_HEIGHT, r = window.app.canvas.canvas.getBoundingClientRect();
        return [r.left + (n.pos[0] + ds.offset[0]) * ds.scale, r.top + (n.pos[1] - T + ds.offset[1]) * ds.scale,
                n.size[0] * ds.scale, (n.size[1] + T) * ds.scale]; }})()""")


def region_png(page, rect):
    x, y, w, h = rect
    params = {"format": "png", "clip": {"x": x, "y": y, "width": w, "height": h, "scale": 1}}
    return base64.b64decode(page.send("Page.captureScreenshot", params)["data"])


def move_node(page, node_id, dx):
    page.evaluate(f"""(() => {{ const n = window.app.graph.getNodeById({node_id}); n.pos[0] += {dx};
        window.app.canvas.setDirty(true, true); window.app.canvas.draw(true, true); return true; }})()""")
    time.sleep(0.3)


# -- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    base = make_base_dir(str(tmp_path_factory.mktemp("frontend_base")))
    client = start_server(base, log_name="comfyui.log", frontend=True)
    try:
        status, html, _ = client.request("GET", "/")
        assert status == 200 and b"<title>ComfyUI" in html, \
            f"ComfyUI {comfyui_version()} serves no frontend at / (HTTP {status}): {html[:300]!r}"
        browser = Browser.launch()
    except BaseException:
        stop_server(client)
        raise
    print(f"\nComfyUI {comfyui_version()} on port {client.port}, log {client.log_path}; screenshots in {base}")
    try:
        yield client, browser, base
    finally:
        browser.close()
        stop_server(client)


@pytest.fixture(scope="module")
def page(frontend):
    client, browser, _ = frontend
    page = browser.new_page(*VIEW)
    open_app(page, client.url)
    return page


@pytest.fixture(scope="module")
def object_info(frontend):
    return frontend[0].get("/object_info")


# -- tests ------------------------------------------------------------------------------------------

def test_thumbnails_are_served(frontend):
    client = frontend[0]
    for name in UI_WORKFLOWS:
        path = os.path.join(WORKFLOWS, f"{name}.jpg")
        assert os.path.isfile(path), f"{path}: no thumbnail (make it with: tests/test_frontend.py --thumbnails)"
        with open(path, "rb") as f:
            data = f.read()
        assert jpeg_size(data) == (THUMBNAIL_SIZE, THUMBNAIL_SIZE)
        assert client.get(thumbnail_url(name)) == data


def test_template_browser_shows_thumbnails(frontend, page):
    base = frontend[2]
    open_templates(page)
    # a card's image loads once it is on screen; the frontend fetches it and shows it from a blob: URL
    loaded = " && ".join(
        f"(() => {{ const i = document.querySelector('[data-testid=\"template-workflow-{n}\"] img');"
        f" return !!i && i.complete && i.naturalWidth == {THUMBNAIL_SIZE}; }})()" for n in UI_WORKFLOWS)
    try:
        page.wait_for(loaded, timeout=30)
    except TimeoutError:
        pass  # the checks below say what is shown instead
    shot = page.screenshot(os.path.join(base, "template_browser.png"))
    print(f"\n{shot}")
    fetched = [[urllib.parse.urlsplit(url).path, status] for url, status in page.responses()]
    for name in UI_WORKFLOWS:
        card = card_state(page, name)
        assert card and name in card["text"], card
        assert [thumbnail_url(name), 200] in fetched, \
            f"{name}: the frontend did not fetch {thumbnail_url(name)}: {[f for f in fetched if 'workflow' in f[0]]}"
        shown = [i for i in card["images"] if i["complete"] and (i["width"], i["height"]) == (THUMBNAIL_SIZE,) * 2]
        assert shown, f"{name}: the card shows {card['images']}, not the {THUMBNAIL_SIZE}x{THUMBNAIL_SIZE} thumbnail"
    close_dialogs(page)


def test_missing_node_is_flagged(page):
    """The check below can fail: a graph with a node type nobody defines is flagged."""
    wf = load_ui("z_image_turbo")
    wf["nodes"] = [dict(wf["nodes"][0], type="ZImageNoSuchNode", id=1)]
    wf["links"] = []
    for inp in wf["nodes"][0].get("outputs", []):
        inp["links"] = []
    page.evaluate(f"window.app.loadGraphData({json.dumps(wf)}).then(() => true)")
    time.sleep(1.5)
    nodes = page.evaluate(GRAPH_NODES)
    assert [n["registered"] for n in nodes] == [False]
    assert page.evaluate(MISSING_DIALOG) or nodes[0]["has_errors"], "an unknown node went unnoticed"
    close_dialogs(page)


@pytest.mark.parametrize("name", UI_WORKFLOWS)
def test_workflow_loads_from_template_without_missing_nodes(frontend, page, name):
    nodes = load_from_template(page, name)
    shot = page.screenshot(os.path.join(frontend[2], f"{name}_loaded.png"))
    print(f"\n{shot}")
    wf = load_ui(name)
    assert sorted(n["type"] for n in nodes) == sorted(n["type"] for n in wf["nodes"])
    unknown = [n["type"] for n in nodes if not n["registered"] or n["has_errors"]]
    assert not unknown, f"{name}: nodes the frontend does not know: {unknown}"
    assert not page.evaluate(MISSING_DIALOG), f"{name}: the frontend warns: {page.evaluate(MISSING_DIALOG)}"
    assert page.evaluate("window.app.graph.links ? Object.keys(window.app.graph.links).length : -1") \
        in (len(wf["links"]), -1)
    if page.evaluate("typeof window.app.graph.links.size") == "number":  # a Map in newer frontends
        assert page.evaluate("window.app.graph.links.size") == len(wf["links"])


def test_pack_nodes_render(frontend, page, object_info):
    nodes = load_from_template(page, "z_image_turbo")
    fit_graph(page, 80, 110, VIEW[0] - 100, VIEW[1] - 130)
    shot = page.screenshot(os.path.join(frontend[2], "z_image_turbo_pack_nodes.png"))
    print(f"\n{shot}")
    by_type = {n["type"]: n for n in nodes}
    for node_type in PACK_NODES:
        assert node_type in by_type, f"{node_type} is not in the loaded graph"
        n = by_type[node_type]
        assert n["registered"] and not n["has_errors"], n
        assert n["module"] and PACK in n["module"], f"{node_type}: defined by {n['module']!r}, not the pack"
        info = object_info[node_type]["input"]
        declared = {**info.get("required", {}), **info.get("optional", {})}
        widget_inputs = {k for k, v in declared.items() if isinstance(v[0], list) or v[0] in
                         ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")}
        assert widget_inputs <= set(n["widgets"]), (node_type, widget_inputs - set(n["widgets"]))
        link_inputs = set(declared) - widget_inputs
        assert {i for i in link_inputs if i in info.get("required", {})} <= set(n["inputs"]), (node_type, n["inputs"])
        # drawn: the picture where the node stands changes when the node is moved away
        rect = node_screen_rect(page, n["id"])
        assert rect[2] > 20 and rect[3] > 20, (node_type, rect)
        assert rect[0] >= 0 and rect[1] >= 0 and rect[0] + rect[2] <= VIEW[0] and rect[1] + rect[3] <= VIEW[1], \
            f"{node_type} is off screen at {rect}"
        drawn = region_png(page, rect)
        move_node(page, n["id"], 100000)
        try:
            empty = region_png(page, rect)
        finally:
            move_node(page, n["id"], -100000)
        assert drawn != empty, f"{node_type}: nothing is drawn where the node stands"
        assert region_png(page, rect) == drawn, f"{node_type}: the node does not come back when moved back"


# -- thumbnails -------------------------------------------------------------------------------------
# the card a thumbnail shows: a title, the graph, one line (JavaScript, called with those and the size)
THUMBNAIL_CARD = """(graph, title, subtitle, line, size) => {
    const d = document.createElement('div'); d.id = 'zimage-thumbnail';
    d.style.cssText = `position:fixed;left:0;top:0;width:${size}px;height:${size}px;z-index:2147483647;
      background:#151517;color:#f2f2f2;font-family:Inter,Arial,sans-serif;display:flex;
      flex-direction:column;box-sizing:border-box;padding:44px 36px;`;
    d.innerHTML = `<div style="font-size:64px;font-weight:700;letter-spacing:-1px">${title}</div>
      <div style="font-size:38px;color:#7cb3ff;margin-top:4px">${subtitle}</div>
      <div style="flex:1;display:flex;align-items:center;justify-content:center;margin:24px 0;min-height:0">
        <img src="data:image/png;base64,${graph}" style="max-width:100%;max-height:100%;
          border-radius:10px;border:1px solid #333"></div>
      <div style="font-size:26px;line-height:1.3;color:#c8c8c8">${line}</div>`;
    document.body.appendChild(d); return true; }"""


def make_thumbnails(out_dir=WORKFLOWS):
    """Render each UI workflow in the frontend and write workflows/<name>.jpg (a square card)."""
    import tempfile

    base = make_base_dir(tempfile.mkdtemp(prefix="zimage_thumbnails_"))
    # a clean canvas: no first-start template browser, minimap, canvas menu or badges
    os.makedirs(os.path.join(base, "user", "default"), exist_ok=True)
    with open(os.path.join(base, "user", "default", "comfy.settings.json"), "w") as f:
        json.dump(CLEAN_CANVAS, f)
    client = start_server(base, log_name="comfyui.log", frontend=True)
    try:
        with Browser.launch() as browser:
            page = browser.new_page(*VIEW)
            open_app(page, client.url)
            for name in UI_WORKFLOWS:
                page.evaluate(f"window.app.loadGraphData({json.dumps(load_ui(name))}).then(() => true)")
                page.wait_for(f"window.app.graph._nodes.length == {len(load_ui(name)['nodes'])}", timeout=60)
                page.evaluate("window.app.canvas.deselectAll ? window.app.canvas.deselectAll() : null; true")
                x0, y0, w, h = 80, 110, VIEW[0] - 100, VIEW[1] - 130
                rect = fit_graph(page, x0, y0, w, h, margin=10)
                graph = base64.b64encode(region_png(page, rect)).decode()
                title, subtitle, line = THUMBNAIL_TEXT[name]
                size = THUMBNAIL_SIZE
                args = ", ".join(json.dumps(a) for a in (graph, title, subtitle, line, size))
                page.evaluate("(" + THUMBNAIL_CARD + ")(" + args + ")")
                page.wait_for("document.querySelector('#zimage-thumbnail img').complete", timeout=10)
                time.sleep(0.3)
                data = page.send("Page.captureScreenshot", {"format": "jpeg", "quality": 88, "clip": {
                    "x": 0, "y": 0, "width": size, "height": size, "scale": 1}})["data"]
                page.evaluate("document.querySelector('#zimage-thumbnail').remove(); true")
                path = os.path.join(out_dir, f"{name}.jpg")
                with open(path, "wb") as f:
                    f.write(base64.b64decode(data))
                print(path)
    finally:
        stop_server(client)


if __name__ == "__main__":
    if sys.argv[1:] != ["--thumbnails"]:
        sys.exit(f"usage: COMFYUI_PATH=... {sys.executable} tests/test_frontend.py --thumbnails")
    reason = skip_reason()
    if reason:
        sys.exit(reason)
    make_thumbnails()
