"""The trainer state (DCP: model, optimizer, RNG, extra) round-trips after real optimizer steps."""

import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.trainer_state import load_trainer_state, make_optimizer, save_trainer_state
def test_trainer_state_round_trip_after_steps(tmp_path):
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.preset("tiny"))
    opt = make_optimizer(m, 1e-3)
    ids = torch.randint(0, 256, (2, 8))
    for _ in range(2):
        opt.zero_grad()
        m(ids, targets=ids.roll(-1, 1)).loss.backward()
        opt.step()
    assert all(p in opt.state for p in m.parameters() if p.requires_grad)  # every trainable weight stepped
    save_trainer_state(tmp_path / "s", m, opt, {"iteration": 3, "data_cursor": {"next_iteration": 3}})
    expect_rng = torch.get_rng_state()
    torch.manual_seed(123)
    m2, opt2, extra = load_trainer_state(tmp_path / "s", lr=1e-3)
    assert extra["iteration"] == 3
    assert torch.equal(torch.get_rng_state(), expect_rng)
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    # one more identical step on both gives identical weights (optimizer moments restored)
    for model, o in ((m, opt), (m2, opt2)):
        o.zero_grad()
        model(ids, targets=ids.roll(-1, 1)).loss.backward()
        o.step()
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
