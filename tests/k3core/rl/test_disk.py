"""The disk budget of a run (``k3core/rl/disk.py``): a trainer state's size from the config against a
real save's files, the states retention keeps at once with one being written, what a resumed run
still needs, the flags that fit, and telling a full disk in an exception's chain."""

import errno

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from k3core.config import K3Config
from k3core.rl import disk
from k3core.settings import RLSettings

pytestmark = pytest.mark.usefixtures("single_thread")


def _saved_state(tmp_path, preset: str):
    from k3core.checkpoint.hf import meta_model
    from k3core.checkpoint.odirect import ODirectFileSystemWriter
    from k3core.rl.trainer_state import make_optimizer, save_trainer_state

    model = meta_model(K3Config.preset(preset))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    out = tmp_path / "state"
    save_trainer_state(out, model, make_optimizer(model, 1e-3), {"iteration": 0},
                       storage_writer_factory=lambda path: ODirectFileSystemWriter(path))
    return model, out


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_state_estimate_matches_a_real_save(tmp_path, preset):
    """The estimate names the tensors the state holds (8 B per trainable element: the fp32 master and
    two bf16 moments; buffers and frozen parameters at their dtype) and is within 3% of the files'
    bytes. A state that still stores the weights beside the masters (``model.*`` entries for the
    trainable parameters: the layout before the weights were dropped) is compared against the
    estimate with those weights, at their dtype, read from the DCP metadata."""
    model, out = _saved_state(tmp_path, preset)
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    meta = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    trainable = {f"model.{n}" for n, p in model.named_parameters() if p.requires_grad}
    stored_weights = {k: v for k, v in meta.items() if k in trainable}
    dtype = next(iter(stored_weights.values())).properties.dtype if stored_weights else None
    entries = disk.state_entries(K3Config.preset(preset), with_weights_dtype=dtype)
    tensors = {k for k, v in meta.items() if hasattr(v, "size")}
    assert {k for k, _, _ in entries} == tensors
    for key, n, dt in entries:  # each entry's elements and dtype are the saved tensor's
        size = meta[key].size
        assert (torch.Size(size).numel(), meta[key].properties.dtype) == (n, dt), key
    estimate = disk.trainer_state_bytes(K3Config.preset(preset), with_weights_dtype=dtype)
    assert abs(estimate - on_disk) / on_disk < 0.03, (estimate, on_disk)


def test_state_bytes_are_eight_per_trainable_parameter_and_no_weights():
    config = K3Config.preset("small")
    from k3core.checkpoint.hf import meta_model

    n = sum(p.numel() for p in meta_model(config).parameters() if p.requires_grad)
    got = disk.trainer_state_bytes(config)
    assert 8 * n < got < 8 * n * 1.01
    assert disk.trainer_state_bytes(config, with_weights_dtype=torch.bfloat16) - got >= 2 * n


def test_states_at_peak_are_the_kept_ones_and_one_being_written():
    assert disk.states_at_peak(30, 0, keep=0, max_staleness=0) == 30  # keep all
    assert disk.states_at_peak(30, 0, keep=1, max_staleness=0) == 2
    assert disk.states_at_peak(30, 0, keep=1, max_staleness=1) == 3  # the one before the latest stays
    assert disk.states_at_peak(30, 0, keep=3, max_staleness=0) == 4
    assert disk.states_at_peak(1, 0, keep=3, max_staleness=0) == 1  # fewer writes than kept
    assert disk.states_at_peak(0, 2, keep=1, max_staleness=0) == 0  # nothing left to write
    assert disk.states_at_peak(5, 2, keep=2, max_staleness=0) == 1  # a resume: two on disk already
    assert disk.states_at_peak(5, 3, keep=1, max_staleness=0) == 1  # more on disk than kept: pruned after the next
    assert disk.saved_versions(7, 3) == [3, 6, 7] and disk.saved_versions(3, 1) == [1, 2, 3]


def _settings(**flat):
    return RLSettings.from_dict({"preset": "tiny", "run_id": "r", **flat})


def test_a_run_needs_its_states_prepared_weights_and_tables():
    s = _settings(iterations=10, keep_checkpoints=2, warmup_steps=5)
    state = disk.trainer_state_bytes(K3Config.preset("tiny"))
    n = disk.run_disk_need(s, prompt_tokens=64)
    assert n.states == 3 and n.state_bytes == state
    assert n.prepared == disk.prepared_bytes(K3Config.preset("tiny"))
    assert n.tables == 10 * disk.table_bytes_per_iteration(K3Config.preset("tiny"), s, 64)
    assert n.total == 3 * state + n.prepared + n.tables
    # a resumed run: prepared and five iterations published, latest version 5, two states on disk
    done = disk.RunProgress(frozenset({"source", "warmup", "rollout-weights-v0"}), 5, 5, 2)
    r = disk.run_disk_need(s, done, prompt_tokens=64)
    assert (r.prepared, r.states, r.tables) == (0, 1, n.tables // 2)
    # --save-every 4 writes versions 4, 8 and 10; --keep-checkpoints 0 keeps all three
    assert disk.run_disk_need(_settings(iterations=10, keep_checkpoints=0, save_every=4)).states == 3


def test_run_progress_reads_what_a_local_root_has_published(tmp_path):
    import json

    from k3core.artifacts import COMPLETE

    run = tmp_path / "runs" / "r"
    assert disk.run_progress(tmp_path, "r") == disk.RunProgress()
    for d in ("source", "warmup", "iter-0000/trainer", "iter-0001/trainer"):
        (run / d).mkdir(parents=True)
        (run / d / COMPLETE).write_text("")
    (run / "iter-0002" / "trainer").mkdir(parents=True)  # no marker: not a state
    for i in (0, 1):
        (run / f"iter-{i:04d}" / "scored.parquet").write_bytes(b"x")
    (run / "latest.json").write_text(json.dumps({"version": 2}))
    assert disk.run_progress(tmp_path, "r") == disk.RunProgress(frozenset({"source", "warmup"}), 2, 2, 2)


def test_the_flags_that_fit_name_their_need():
    s = _settings(iterations=30, keep_checkpoints=0)
    state = disk.trainer_state_bytes(K3Config.preset("tiny"))

    def need_of(x):
        return disk.run_disk_need(x, prompt_tokens=16)

    free = need_of(_settings(iterations=30, keep_checkpoints=3)).total + state // 2  # room for 4 states, not 5
    flags = disk.fitting_flags(s, free, need_of)
    assert flags[0] == f"--keep-checkpoints 3 (needs {disk.gb(need_of(_settings(iterations=30, keep_checkpoints=3)).total)})"
    assert flags[1].startswith("--save-every ") and flags[-1].startswith("another --artifacts with at least")
    assert disk.fitting_flags(s, 0, need_of) == [f"another --artifacts with at least {disk.gb(need_of(s).total)} free"]


def test_a_full_disk_is_told_through_the_exception_chain():
    full = OSError(errno.ENOSPC, "No space left on device", "/x/y")
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("the stage failed") from e
    except RuntimeError as wrapped:
        assert disk.disk_full_error(wrapped) is full
    assert disk.disk_full_error(OSError(errno.EDQUOT, "Disk quota exceeded")) is not None
    assert disk.disk_full_error(OSError(errno.EIO, "I/O error")) is None and disk.disk_full_error(ValueError()) is None


def test_the_run_is_sized_from_the_config_its_source_makes(tmp_path):
    """A fresh medium checkpoint carries the bundled BPE, whose vocabulary is far smaller than the
    release's: the need follows the checkpoint the run will train, not the preset's table. A fetched
    run's own config.json wins over both."""
    from k3core.checkpoint.hf import init_checkpoint
    from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer

    s = RLSettings.from_dict({"model": {"preset": "medium"}, "pipeline": {"artifacts": str(tmp_path), "run_id": "r"}})
    assert s.model.source == "init:medium:0:bpe"
    config = disk.run_config(s)
    assert config.vocab_size == load_tokenizer(BUNDLED_K3_BPE).vocab_size < K3Config.preset("medium").vocab_size
    assert disk.trainer_state_bytes(config) < disk.trainer_state_bytes(K3Config.preset("medium"))

    fetched = tmp_path / "runs" / "r" / "tokenizer"
    init_checkpoint("tiny", fetched, seed=0)
    assert disk.run_config(s).vocab_size == K3Config.preset("tiny").vocab_size
