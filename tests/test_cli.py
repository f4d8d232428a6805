"""The command lines: `python -m zimage_core` (plan), `python -m tools` (bench, random-weights) and
`workflows/api/run.py`. Every bad input gives one line and a non-zero exit status.

Starting `python -m zimage_core` imports torch (seconds), so most cases call its `main()` in this
process; the subprocess cases check the real entry point, run concurrently."""
import functools
import http.server
import json
import os
import socket
import shutil
import struct
import subprocess
import sys
import threading

import pytest

from conftest import TINY
from tools import __main__ as tools_cli
from zimage_core import __main__ as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_PY = os.path.join(ROOT, "workflows", "api", "run.py")
BAD_ARGS = 2  # argparse's exit status


TOOL_COMMANDS = ("bench", "random-weights", "ratio", "dequant")


def main_for(argv):
    return tools_cli.main if argv and argv[0] in TOOL_COMMANDS else cli.main


def run_main(argv, capsys):
    """(exit status, stdout, stderr) of the command line's main(argv), as the interpreter would
    report them."""
    try:
        main_for(argv)(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    if isinstance(code, str):  # sys.exit("message"): printed to stderr, status 1
        err, code = err + code + "\n", 1
    return code or 0, out, err


def one_line(text):
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["plan", "--vram-gib", "-1"], ["--vram-gib", "-1", "from 0 up to"]),
    (["plan", "--vram-gib", "nan"], ["--vram-gib", "'nan'", "finite"]),
    (["plan", "--vram-gib", "inf"], ["--vram-gib", "'inf'", "finite"]),
    (["plan", "--vram-gib", "1e300"], ["--vram-gib", "up to"]),
    (["plan", "--vram-gib", "lots"], ["--vram-gib", "'lots' is not a number"]),
    (["plan", "--batch", "0"], ["--batch", "give 1 to 64"]),
    (["plan", "--batch", "65"], ["--batch", "give 1 to 64"]),
    (["plan", "--width", "1000"], ["--width", "multiples of 16", "try 992"]),
    (["plan", "--height", "0"], ["--height", "multiples of 16"]),
    (["plan", "--height", "-16"], ["--height", "multiples of 16"]),
    (["plan", "--width", "8192"], ["--width", "from 16 to 4096"]),
    (["plan", "--width", "10.5"], ["--width", "not a whole number"]),
    (["bench", "--weights", "README.md", "--width", "1000"], ["--width", "multiples of 16", "try 992"]),
    (["bench", "--weights", "README.md", "--height", "4112"], ["--height", "from 16 to 4096"]),
    (["bench", "--weights", "README.md", "--steps", "0"], ["--steps", "give 1 to 200"]),
    (["bench", "--weights", "README.md", "--resident-layers", "30,x"], ["--resident-layers", "30,18,0"]),
    (["bench", "--weights", "README.md", "--resident-layers", "-1"], ["--resident-layers", "0 or more"]),
    (["bench", "--weights", "README.md", "--simulate-card-gib", "0"], ["--simulate-card-gib", "above 0"]),
    (["bench", "--weights", "README.md", "--device", "gpu7"], ["--device", "not a device"]),
    (["bench", "--weights", "no_such_file.safetensors"], ["--weights", "no such file or folder: no_such_file.safetensors"]),
    (["bench"], ["required", "--weights"]),
    (["random-weights", "tests"], ["tests is a folder", "z_image_turbo_bf16.safetensors"]),
    (["random-weights", "x.ckpt"], [".safetensors"]),
    (["random-weights", "x.safetensors", "--layers", "0"], ["--layers", "give 1 to 64"]),
    (["ratio", "--weights", "no_such_file.safetensors"], ["--weights", "no such file or folder: no_such_file.safetensors"]),
    (["ratio", "--weights", "README.md", "--layers", "0"], ["--layers", "give 1 to 64"]),
    (["bench", "--weights", "README.md", "--compression", "maybe"], ["--compression", "invalid choice"]),
    (["plan", "--no-such-option"], ["unrecognized arguments"]),
    (["dequant", "--cols", "300"], ["--cols", "not a multiple of 256"]),
    (["dequant", "--device", "gpu7"], ["--device", "not a device"]),
    ([], ["required", "plan"]),
])
def test_bad_arguments(argv, words, capsys):
    code, out, err = run_main(argv, capsys)
    line = one_line(err)
    assert code == BAD_ARGS, (code, err)
    assert not out
    prog = "python -m tools" if argv and argv[0] in TOOL_COMMANDS else "python -m zimage_core"
    assert line.startswith(prog) and "error:" in line, line
    for w in words:
        assert w in line, (w, line)


def test_plan_fits(capsys):
    code, out, err = run_main(["plan", "--vram-gib", "11.5", "--width", "1024", "--height", "1024"], capsys)
    assert code == 0 and not err
    assert out.startswith("Z-Image: ") and "layers on the GPU" in out


@pytest.mark.parametrize("ram, where", [("28", "it stays in the page cache"),
                                        ("14", "it is read from the disk at each new prompt")])
def test_plan_says_where_the_text_encoder_is_read_from(ram, where, capsys):
    """On a 32 GB machine the text encoder's file stays cached beside an 8 GB card's pinned layers;
    on a 16 GB one (bf16) it does not, and every new prompt reads it from the disk."""
    code, out, err = run_main(["plan", "--vram-gib", "7.5", "--ram-gib", ram], capsys)
    line = next(line for line in out.splitlines() if line.strip().startswith("text encoder"))
    assert code == 0 and where in line, line


def _with_env(monkeypatch, **env):
    """Only the given ZIMAGE_* settings, as a process started with them would see: a process reads
    them once, so the test gets a reading of its own (the process's comes back after it)."""
    from zimage_core import environment
    for name in ("ZIMAGE_PINNED_GIB", "ZIMAGE_COMPRESSION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(environment, "_reading", functools.cache(environment._reading.__wrapped__))


def _plan(capsys, monkeypatch, **env):
    _with_env(monkeypatch, **env)
    code, out, err = run_main(["plan", "--vram-gib", "7.5", "--ram-gib", "28", "--json"], capsys)
    assert code == 0 and not err, (code, err)
    return json.loads(out)


def test_plan_reads_the_pinned_cap_as_the_nodes_do(capsys, monkeypatch):
    """ZIMAGE_PINNED_GIB caps the pinned masters the plan gives an 8 GB card on a 32 GB machine."""
    unset, four, zero = (_plan(capsys, monkeypatch, ZIMAGE_COMPRESSION="off", **cap) for cap in
                         ({}, {"ZIMAGE_PINNED_GIB": "4"}, {"ZIMAGE_PINNED_GIB": "0"}))
    assert unset["pinned_layers"] > four["pinned_layers"] > zero["pinned_layers"] == 0, (unset, four, zero)
    assert four["pinned_host_bytes"] <= 4 << 30
    assert zero["file_layers"] == zero["streamed_layers"]


def test_plan_compresses_where_the_environment_says_so(capsys, monkeypatch):
    on, off = (_plan(capsys, monkeypatch, ZIMAGE_COMPRESSION=mode) for mode in ("on", "off"))
    assert on["master_bytes"] < on["layer_bytes"] and off["master_bytes"] == off["layer_bytes"]


@pytest.mark.parametrize("name, value", [("ZIMAGE_PINNED_GIB", "bogus"), ("ZIMAGE_PINNED_GIB", "-1"),
                                         ("ZIMAGE_PINNED_GIB", "nan"), ("ZIMAGE_COMPRESSION", "bogus")])
def test_plan_and_bench_refuse_a_bad_setting(name, value, capsys, monkeypatch, tiny_file):
    """Refused by the command lines as the nodes refuse it, in one line, before any work."""
    _with_env(monkeypatch, **{name: value})
    for argv in (["plan", "--vram-gib", "7.5"], ["bench", "--weights", tiny_file, "--device", "cpu"]):
        code, out, err = run_main(argv, capsys)
        line = one_line(err)
        assert code == 1 and not out, (argv, code, out, err)
        assert name in line and repr(value) in line and "unset it" in line, line


def test_bench_takes_a_folder_as_the_loader_does(capsys, monkeypatch, tiny_file):
    _with_env(monkeypatch)
    code, out, err = run_main(["bench", "--weights", os.path.dirname(tiny_file), "--device", "cpu", "--steps", "1",
                               "--width", "64", "--height", "64", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["steps"] == 1


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_plan_does_not_fit_exits_non_zero(extra, capsys):
    for gib in ("0", "0.5"):
        code, out, err = run_main(["plan", "--vram-gib", gib, *extra], capsys)
        assert code == cli.DOES_NOT_FIT, (code, out, err)
        if extra:
            assert json.loads(out)["fits"] is False
        else:
            assert "does not fit" in out.splitlines()[0]


def test_dequant_times_every_type_the_loader_reads(capsys):
    from zimage_core import quants
    code, out, err = run_main(["dequant", "--device", "cpu", "--rows", "8", "--cols", "256"], capsys)
    assert code == 0 and not err
    lines = out.splitlines()
    assert lines[0] == "one 8x256 matrix dequantized into bf16 on cpu:"
    assert [line.split()[0] for line in lines[1:]] == list(quants.TYPES)
    assert all(float(line.split()[1]) > 0 for line in lines[1:])


def test_help_texts(capsys):
    for cmd, phrases in (("plan", ["image width in pixels", "image height in pixels", "images made at once",
                                   "print the plan as one JSON object"]),
                         ("bench", ["a Z-Image transformer .safetensors file", "image width in pixels",
                                    "one JSON object per line"]),
                         ("random-weights", ["the .safetensors file to write", "main transformer layers",
                                             "N(0, 0.02) for every matrix"]),
                         ("ratio", ["a Z-Image transformer .safetensors file", "only the first N layers"])):
        with pytest.raises(SystemExit) as e:
            main_for([cmd])([cmd, "--help"])
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        for phrase in phrases:
            assert phrase in text, (cmd, phrase, text)


def test_random_weights_creates_the_folder(tmp_path, monkeypatch, capsys):
    """A folder that does not exist is created (full-size weights would take a minute: the tiny config)."""
    real = tools_cli.write_checkpoint
    monkeypatch.setattr(tools_cli, "write_checkpoint", lambda path, cfg, **kw: real(path, TINY, **kw))
    out = tmp_path / "new" / "deeper" / "z.safetensors"
    code, stdout, err = run_main(["random-weights", str(out), "--dtype", "fp32"], capsys)
    assert code == 0, err
    assert out.is_file() and "created" in stdout and "wrote" in stdout
    with open(out, "rb") as f:
        assert struct.unpack("<Q", f.read(8))[0] > 0


def test_random_weights_folder_cannot_be_made(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, _, err = run_main(["random-weights", str(blocker / "sub" / "z.safetensors")], capsys)
    assert code == 1
    assert "cannot create the folder" in one_line(err)


def test_entry_point_exit_statuses():
    """The real `python -m zimage_core`: status and a single stderr line per case."""
    cases = {("plan", "--vram-gib", "nan"): BAD_ARGS, ("plan", "--vram-gib", "1"): cli.DOES_NOT_FIT}
    procs = {args: subprocess.Popen([sys.executable, "-m", "zimage_core", *args], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args in cases}
    for args, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == cases[args], (args, proc.returncode, out, err)
        if cases[args] == BAD_ARGS:
            one_line(err)
        else:
            assert not err and "does not fit" in out


# -- workflows/api/run.py against a server that dies ------------------------------------------------

class _DyingHandler(http.server.BaseHTTPRequestHandler):
    """Queues the prompt, or not, then drops the connection the way a server that dies does."""
    mode = "post"

    def log_message(self, *args):
        pass

    def _drop(self, reset):
        if reset:  # RST instead of FIN: the client sees ConnectionResetError
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))  # the whole request, then nothing
        if self.mode == "post":
            return self._drop(reset=False)
        body = json.dumps({"prompt_id": "p1", "number": 0, "node_errors": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.mode == "history-partial":  # the answer starts, then the server dies
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"p1": {"status"')
            self.wfile.flush()
            return self._drop(reset=False)
        self._drop(reset=self.mode == "history-reset")


@pytest.fixture
def dying_server(request):
    handler = type("Handler", (_DyingHandler,), {"mode": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run_script(*args):
    return subprocess.run([sys.executable, RUN_PY, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("dying_server", ["post", "history-closed", "history-reset", "history-partial"],
                         indirect=True)
def test_run_script_server_dies(dying_server, tmp_path):
    r = run_script("--server", dying_server, "--out", str(tmp_path / "images"), "--timeout", "30")
    line = one_line(r.stderr)
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert line.startswith("lost the connection to ComfyUI at " + dying_server), line
    assert "Did the server stop?" in line
    assert not (tmp_path / "images").exists()


def test_run_script_server_down(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_script("--server", f"http://127.0.0.1:{port}", "--out", str(tmp_path))
    assert r.returncode != 0
    assert "cannot reach ComfyUI" in one_line(r.stderr)


@pytest.mark.parametrize("content, words", [(None, "cannot read the workflow"), ("{not json", "is not JSON"),
                                            ("[1, 2]", "is not an API-format workflow")])
def test_run_script_bad_workflow_file(tmp_path, content, words):
    path = tmp_path / "wf.json"
    if content is not None:
        path.write_text(content)
    r = run_script("--workflow", str(path), "--server", "http://127.0.0.1:9")
    assert r.returncode != 0
    assert words in one_line(r.stderr)


def test_run_script_names_a_ui_workflow(tmp_path):
    path = tmp_path / "wf.json"
    shutil.copy(os.path.join(ROOT, "workflows", "z_image_turbo.json"), path)  # the UI-format twin
    r = run_script("--workflow", str(path), "--server", "http://127.0.0.1:9")
    assert r.returncode != 0
    line = one_line(r.stderr)
    assert "is a UI workflow" in line and "Export (API)" in line, line


def test_run_script_checks_the_output_folder_first(tmp_path):
    """An --out that cannot be a folder fails before anything is posted (no server listens on port 9)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = run_script("--out", str(blocker / "images"), "--server", "http://127.0.0.1:9")
    assert r.returncode != 0
    line = one_line(r.stderr)
    assert line.startswith(f"cannot save the images in {blocker / 'images'}") and "not a folder" in line, line
