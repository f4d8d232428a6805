"""The server benchmark's reading of a server's log (``tools/server_processes.py``): where an
image's seconds went, from the pack's debug lines and the stamps the benchmark puts on each line."""
import time

from tools.server_processes import Server

IMAGE = """\
    {t:.3f} got prompt
    {t1:.3f} [DEBUG] Z-Image: prompt encoded in 0.14 s (0 of 36 layers resident)
    {t2:.3f} [DEBUG] Z-Image: split set in 0.00 s (13 -> 13 resident, 6.696 GiB free; its simulated step 0.1039 s)
    {t3:.3f} [DEBUG] Z-Image: sampled 8 steps in 0.92 s (the first 0.13 s, with loading; then 0.110 s a step); 0 layer uploads read the checkpoint
    {t4:.3f} [DEBUG] Z-Image: decoded in 0.11 s
"""


def image(t):
    return IMAGE.format(t=t, t1=t + 0.15, t2=t + 0.16, t3=t + 1.08, t4=t + 1.2)


def done(t):
    return f"    {t:.3f} [INFO] Prompt executed in 1.39 seconds\n"


def test_an_images_seconds_after_its_decode(tmp_path):
    log = tmp_path / "server.log"
    server = Server(None, 0, str(log))
    log.write_text(image(10.0) + done(11.39))
    row = server.new_log()
    assert row["after_decode_s"] == 0.19  # 11.39 - 11.2: ComfyUI's save, after the pack's decode
    assert (row["encode_s"], row["decode_s"], row["step_bound_s"]) == (0.14, 0.11, 0.1039)

    # an image whose "Prompt executed" line comes late, with the next image's text: neither image
    # is given the time from one's decode to the other's line
    with open(log, "a") as f:
        f.write(image(12.0))
    assert "after_decode_s" not in server.new_log()
    with open(log, "a") as f:
        f.write(done(13.41) + image(14.0))
    assert "after_decode_s" not in server.new_log()


def test_the_wait_for_the_prompts_line(tmp_path):
    """ComfyUI records a prompt's success before it logs "Prompt executed": the client waits for
    the line, and gives up after its time-out where none comes."""
    log = tmp_path / "server.log"
    log.write_text(image(10.0))
    server = Server(None, 0, str(log))
    server._wait_done(0.05)
    assert "after_decode_s" not in server.new_log()
    with open(log, "a") as f:
        f.write(image(12.0) + done(13.3))
    start = time.monotonic()
    server._wait_done(5.0)
    assert time.monotonic() - start < 1.0  # the line is there: no wait
    assert server.new_log()["after_decode_s"] == 0.1
