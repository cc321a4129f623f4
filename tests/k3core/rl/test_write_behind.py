"""A trainer state written beside the next stages: the next update's first optimizer step joins the
write before it changes the state; a failed write fails the update with the state untouched."""

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl import trainers
from k3core.rl.trainer_state import make_optimizer, rng_state


def _live():
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.preset("tiny"))
    return trainers.LiveTrainer(1, m, make_optimizer(m, 1e-3), {}, rng_state())


def _step(live):
    ids = torch.randint(0, 256, (2, 8))
    live.optimizer.zero_grad()
    live.model(ids, targets=ids.roll(-1, 1)).loss.backward()
    live.optimizer.step()


def _masters(live):
    return [st["master"].clone() for st in live.optimizer.state.values()]


def test_the_first_step_joins_the_write_before_it_changes_the_state_and_later_steps_do_not():
    live = _live()
    before = _masters(live)
    events = []
    live.writing = lambda: events.append(("join", all(torch.equal(a, b) for a, b in zip(_masters(live), before))))
    with trainers.update_after_write(live):
        for _ in range(2):
            _step(live)
            events.append("step")
    assert events == [("join", True), "step", "step"]
    assert live.writing is None
    assert not all(torch.equal(a, b) for a, b in zip(_masters(live), before))  # the steps did change it


def test_an_update_without_a_step_still_joins_the_write():
    live, joined = _live(), []
    live.writing = lambda: joined.append(True)
    with trainers.update_after_write(live):
        pass
    assert joined == [True]


def test_a_failed_write_fails_the_update_and_leaves_the_state_as_it_was():
    live = _live()
    before = _masters(live)

    def failed():
        raise OSError(28, "No space left on device")

    live.writing = failed
    with pytest.raises(OSError, match="No space"), trainers.update_after_write(live):
        _step(live)
    assert all(torch.equal(a, b) for a, b in zip(_masters(live), before))


def test_the_writer_finds_the_state_after_the_next_update_took_it_from_the_registry():
    trainers.clear()
    live = _live()
    trainers.put("r", live)
    trainers.write_behind("r", 1, lambda: None)
    assert trainers.take("r", 1) is live  # the next train step takes it over before the write begins
    assert trainers.peek("r", 1) is None and trainers.being_written("r", 1) is live
    trainers.written("r", 1)
    assert trainers.being_written("r", 1) is None
