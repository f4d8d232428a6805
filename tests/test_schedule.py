import pytest
import torch

from zimage_core.dit import another_forward_follows
from tools.schedule import shifted, sigmas


def test_sigmas_run_from_one_to_zero_shifted():
    s = sigmas(8)
    assert s.shape == (9,) and s[0] == 1.0 and s[-1] == 0.0
    assert torch.all(s[1:] < s[:-1])
    # the 4th of 8 steps sits at timestep 0.5 of the table: shifted to 3*0.5/(1+2*0.5) = 0.75
    assert s[4].item() == pytest.approx(shifted(torch.tensor(0.5)).item(), abs=1e-6)
    assert shifted(torch.tensor(0.5), 3.0).item() == pytest.approx(0.75)


def test_another_forward_follows_until_the_last_step():
    """Read from the schedule ComfyUI's samplers put in transformer_options: every step but the
    last (the one at the smallest nonzero sigma) is followed by another; unknown means no."""
    table = sigmas(4)
    follows = [another_forward_follows({"sample_sigmas": table, "sigmas": table[i:i + 1]}) for i in range(4)]
    assert follows == [True, True, True, False]
    assert not another_forward_follows({})
    assert not another_forward_follows({"sigmas": table[:1]})
