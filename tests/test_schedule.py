import pytest
import torch

from zimage_core.schedule import shifted, sigmas


def test_sigmas_run_from_one_to_zero_shifted():
    s = sigmas(8)
    assert s.shape == (9,) and s[0] == 1.0 and s[-1] == 0.0
    assert torch.all(s[1:] < s[:-1])
    # the 4th of 8 steps sits at timestep 0.5 of the table: shifted to 3*0.5/(1+2*0.5) = 0.75
    assert s[4].item() == pytest.approx(shifted(torch.tensor(0.5)).item(), abs=1e-6)
    assert shifted(torch.tensor(0.5), 3.0).item() == pytest.approx(0.75)
