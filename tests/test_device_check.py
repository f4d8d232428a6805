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
