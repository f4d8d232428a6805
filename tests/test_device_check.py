"""A kernel's check per device: worked out once, on a thread when asked early, waited for."""
import threading

from zimage_core.device_check import DeviceCheck


def test_a_device_is_checked_once_and_callers_wait_for_a_check_under_way():
    started, release, calls = threading.Event(), threading.Event(), []

    def work(device):
        calls.append(device)
        started.set()
        release.wait(10)
        return device.type == "cuda"

    check = DeviceCheck(work, "test-check")
    check.soon("cpu")  # only CUDA devices are checked ahead
    assert not calls
    check.soon("cuda:0")
    assert started.wait(10)
    answers = []
    waiter = threading.Thread(target=lambda: answers.append(check("cuda:0")))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waits for the check under way instead of starting another
    release.set()
    waiter.join(10)
    assert answers == [True] and check("cuda:0") and not check("cpu")
    check.soon("cuda:0")  # answered: nothing starts
    assert [str(d) for d in calls] == ["cuda:0", "cpu"]


def test_a_triton_check_says_once_why_its_kernels_are_off(caplog):
    """A check that finds wrong values, or that fails (no Triton, no compiler), answers no and says
    what is off, why, and what runs instead; one that finds nothing answers yes, silently."""
    from zimage_core.device_check import triton_check

    def broken(device):
        raise ImportError("No module named 'triton'\nmore lines")

    with caplog.at_level("WARNING", logger="zimage"):
        assert triton_check(lambda d: None, "the good kernels", "nothing", "t1")("cuda:0")
        assert not caplog.records
        assert not triton_check(lambda d: "its q differs", "the wrong kernels", "torch's ops run", "t2")("cuda:0")
        assert not triton_check(broken, "the missing kernels", "torch's ops run", "t3")("cuda:1")
    first, second = (r.getMessage() for r in caplog.records)
    assert "the wrong kernels: off on cuda:0 (its q differs); torch's ops run" in first
    assert "(ImportError: No module named 'triton')" in second and "more lines" not in second
