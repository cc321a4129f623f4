"""A trainer state written beside the next stages: the next update's first optimizer step releases the
write before it changes the state (the writer copies what it has not read yet, or the write has
ended); a failed write fails the update with the state untouched; the state on disk is the one before
the update, bit for bit, however far the write had got when the update started."""

import threading

import pytest
import torch

from k3core.checkpoint import odirect
from k3core.checkpoint.odirect import ODirectFileSystemWriter
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl import trainers
from k3core.rl.trainer_state import load_trainer_state, make_optimizer, rng_state, save_trainer_state


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


def _host_state(optimizer):
    """Every tensor of the optimizer's state, by parameter position and key (copies)."""
    return {(i, k): v.clone() for i, st in enumerate(optimizer.state.values()) for k, v in st.items()}


def _ended(live, join):
    return trainers.WriteBehind(live, join, lambda: True)  # a write that has ended: release joins it


def test_the_first_step_releases_the_write_before_it_changes_the_state_and_later_steps_do_not():
    live = _live()
    before = _masters(live)
    events = []
    live.writing = _ended(live, lambda: events.append(("join", all(torch.equal(a, b) for a, b in zip(_masters(live), before)))))
    with trainers.update_after_write(live) as waited:
        for _ in range(2):
            _step(live)
            events.append("step")
    assert events == [("join", True), "step", "step"]
    assert live.writing is None and waited["release_seconds"] >= 0
    assert not all(torch.equal(a, b) for a, b in zip(_masters(live), before))  # the steps did change it


def test_an_update_without_a_step_still_releases_the_write():
    live, joined = _live(), []
    live.writing = _ended(live, lambda: joined.append(True))
    with trainers.update_after_write(live):
        pass
    assert joined == [True]


def test_a_failed_write_fails_the_update_and_leaves_the_state_as_it_was():
    live = _live()
    before = _masters(live)

    def failed():
        raise OSError(28, "No space left on device")

    live.writing = _ended(live, failed)
    with pytest.raises(OSError, match="No space"), trainers.update_after_write(live):
        _step(live)
    assert all(torch.equal(a, b) for a, b in zip(_masters(live), before))


def test_the_writer_finds_the_state_after_the_next_update_took_it_from_the_registry():
    trainers.clear()
    live = _live()
    trainers.put("r", live)
    trainers.write_behind("r", 1, lambda: None, lambda: False)
    assert trainers.take("r", 1) is live  # the next train step takes it over before the write begins
    assert trainers.peek("r", 1) is None and trainers.being_written("r", 1) is live
    trainers.written("r", 1)
    assert trainers.being_written("r", 1) is None


def _write_held_after(monkeypatch, items: int):
    """Serialising threads of any writer stop before their item ``items + 1`` until the returned
    ``go`` is set; ``reached`` is set when the first of them gets there."""
    reached, go, seen = threading.Event(), threading.Event(), []
    real_tensor, real_cpu = odirect._FreezableSource.tensor, odirect._cpu_tensor

    def hold():
        seen.append(1)
        if len(seen) > items:
            reached.set()
            go.wait(60)

    def tensor(self, item):
        hold()
        return real_tensor(self, item)

    def cpu_tensor(planner, item):
        hold()
        return real_cpu(planner, item)

    monkeypatch.setattr(odirect._FreezableSource, "tensor", tensor)
    monkeypatch.setattr(odirect, "_cpu_tensor", cpu_tensor)
    return reached, go


def _save_with_update_midway(tmp_path, monkeypatch, freezable: bool, arena=None):
    """Write ``live``'s state in a thread, stopped after 5 of its tensors; meanwhile two optimizer
    steps run, released through ``update_after_write`` when the writer is freezable. Returns the
    state before the steps, the state after them and the directory written."""
    live = _live()
    before = _host_state(live.optimizer)
    reached, go = _write_held_after(monkeypatch, 5)
    out, failures = tmp_path / "state", []

    def writer(path):
        w = ODirectFileSystemWriter(path, freezable=freezable, direct=False, thread_count=2, snapshot_arena=arena)
        if freezable:
            trainers.writing_with(live, w)
        return w

    def save():
        try:
            save_trainer_state(out, live.model, live.optimizer, {}, storage_writer_factory=writer, rng=live.rng)
        except BaseException as e:  # noqa: BLE001 - asserted below
            failures.append(e)

    thread = threading.Thread(target=save)
    thread.start()
    assert reached.wait(60), "the write never reached its sixth tensor"
    if freezable:
        live.writing = trainers.WriteBehind(live, thread.join, lambda: not thread.is_alive())
        with trainers.update_after_write(live):
            for _ in range(2):
                _step(live)
    else:
        for _ in range(2):
            _step(live)
    after = _host_state(live.optimizer)
    go.set()
    thread.join(60)
    assert not failures, failures
    return before, after, out


@pytest.mark.parametrize("arena", [False, True], ids=["fresh-memory", "arena"])
def test_a_frozen_write_saves_the_state_from_before_the_update_bit_for_bit(tmp_path, monkeypatch, arena):
    arena = odirect.SnapshotArena() if arena else None
    before, after, out = _save_with_update_midway(tmp_path, monkeypatch, freezable=True, arena=arena)
    _, saved_opt, _ = load_trainer_state(out, lr=0.0)
    saved = _host_state(saved_opt)
    assert saved.keys() == before.keys()
    assert all(torch.equal(saved[k], before[k]) for k in before)
    assert not all(torch.equal(after[k], before[k]) for k in before)  # the steps changed what it wrote meanwhile
    if arena is not None:  # the freeze copied into it, and gave it back for the next write
        assert arena.nbytes > 0 and arena.take(1) is not None


def test_without_the_freeze_the_same_write_mixes_two_versions(tmp_path, monkeypatch):
    """The control: the tensors the write read after the steps are the steps' (the test above can fail)."""
    before, after, out = _save_with_update_midway(tmp_path, monkeypatch, freezable=False)
    _, saved_opt, _ = load_trainer_state(out, lr=0.0)
    saved = _host_state(saved_opt)
    changed = [k for k in before if not torch.equal(after[k], before[k])]
    assert any(torch.equal(saved[k], after[k]) for k in changed)
    assert any(torch.equal(saved[k], before[k]) for k in changed)


def test_a_write_retried_after_a_freeze_is_refused():
    live = _live()

    class Frozen:
        frozen = True

    live.writer = Frozen()
    with pytest.raises(RuntimeError, match="after the next update had started changing it"):
        trainers.writing_with(live, object())


def test_a_freeze_after_a_failed_data_phase_says_no_and_a_release_then_raises_the_write_error():
    source = odirect._FreezableSource()
    source.start(None, [])
    source.end(ok=False)
    assert source.freeze(timeout=0) is False

    class Writer:
        freeze = staticmethod(source.freeze)

    live = _live()
    live.writer = Writer()

    def join():
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output"):
        trainers.WriteBehind(live, join, lambda: True).release()


def test_arena_copies_own_storages_of_their_size_and_a_busy_arena_gives_fresh_memory():
    arena = odirect.SnapshotArena()
    big = torch.randn(1000)
    tensors = {"view": big[10:20].view(2, 5), "bf16": torch.randn(3, 7).to(torch.bfloat16), "scalar": torch.tensor(4.0)}
    copies, used = odirect._copies_into(arena, tensors)
    assert used and arena.nbytes >= sum(t.numel() * t.element_size() for t in tensors.values())
    for k, t in tensors.items():
        c = copies[k]
        assert torch.equal(c, t) and c.dtype == t.dtype and c.shape == t.shape
        assert c.untyped_storage().nbytes() == t.numel() * t.element_size()  # torch.save writes only these bytes
    big[10:20] = 0  # the copies are copies
    assert not torch.equal(copies["view"], tensors["view"])
    again, used_again = odirect._copies_into(arena, tensors)  # taken: the next write copies into fresh memory
    assert not used_again and all(torch.equal(again[k], tensors[k]) for k in tensors)
    arena.give_back()
    assert arena.take(8) is not None
