"""The trainer state (DCP: model, optimizer, RNG, extra) round-trips after real optimizer steps."""

import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.trainer_state import load_trainer_state, make_optimizer, save_trainer_state


def _step(model, opt, ids):
    opt.zero_grad()
    model(ids, targets=ids.roll(-1, 1)).loss.backward()
    opt.step()


def _stepped_model(seed: int = 0, dtype=torch.float32, lr: float = 1e-3):
    """(model, optimizer, batch): the tiny model after two optimizer steps on one batch."""
    torch.manual_seed(seed)
    m = K3ForCausalLM(K3Config.preset("tiny")).cast(dtype)
    opt = make_optimizer(m, lr)
    ids = torch.randint(0, 256, (2, 8))
    for _ in range(2):
        _step(m, opt, ids)
    return m, opt, ids


def _stepped_bf16_model(seed: int = 0):
    m, opt, _ = _stepped_model(seed, torch.bfloat16, lr=1e-2)
    return m, opt


def test_trainer_state_round_trip_after_steps(tmp_path):
    m, opt, ids = _stepped_model()
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
        _step(model, o, ids)
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n


def _saved_keys(path):
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def test_weights_are_stored_once_and_rebuilt_bit_exact_by_every_loader(tmp_path):
    """The state holds each trainable weight once, as its fp32 master; the trainer's loader and the
    model-only loader (engines, evaluation, export) round it back to exactly the live bf16 weights."""
    from k3core.rl.trainer_state import load_trainer_model

    m, opt = _stepped_bf16_model()
    save_trainer_state(tmp_path / "s", m, opt, {"iteration": 1})
    keys = _saved_keys(tmp_path / "s")
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert not any(f"model.{n}" in keys for n in trainable)
    assert all(f"optim.state.{n}.master" in keys for n in trainable)
    live = {n: t.clone() for n, t in m.state_dict().items()}
    assert any(t.dtype == torch.bfloat16 for t in live.values())
    m2, _, _ = load_trainer_state(tmp_path / "s", lr=1e-2, dtype=torch.bfloat16)
    m3 = load_trainer_model(tmp_path / "s", dtype=torch.bfloat16)
    for loaded in (m2, m3):
        got = loaded.state_dict()
        assert set(got) == set(live)
        for n, t in live.items():
            assert got[n].dtype == t.dtype and torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n


def test_manifest_takes_the_digests_hashed_while_writing_and_a_flipped_byte_is_caught(tmp_path, monkeypatch):
    import hashlib
    import json

    import pytest

    from k3core.checkpoint import manifest as manifest_mod
    from k3core.checkpoint.manifest import MANIFEST_NAME, ManifestError

    m, opt = _stepped_bf16_model(1)
    read_back = []
    real = manifest_mod.sha256_file
    monkeypatch.setattr(manifest_mod, "sha256_file", lambda p, *a: read_back.append(p.name) or real(p, *a))
    save_trainer_state(tmp_path / "s", m, opt, {"iteration": 1})
    assert sorted(read_back) == ["config.json", "extra.json"]  # the DCP files were not read back
    monkeypatch.undo()
    files = json.loads((tmp_path / "s" / MANIFEST_NAME).read_text())["files"]
    for name, ent in files.items():
        data = (tmp_path / "s" / name).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (ent["sha256"], ent["size"]), name
    data_file = next(n for n in files if n.endswith(".distcp"))
    p = tmp_path / "s" / data_file
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    p.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="does not match"):
        load_trainer_state(tmp_path / "s", lr=1e-2, dtype=torch.bfloat16)


def test_a_state_of_the_older_layout_with_weight_copies_still_loads(tmp_path):
    """States written before the weights were stored once hold ``model.*`` copies of every weight:
    they load, to the same weights, the copies unread."""
    import json
    import random

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from k3core.checkpoint.manifest import write_manifest
    from k3core.rl.trainer_state import load_trainer_model

    m, opt = _stepped_bf16_model(2)
    msd, osd = get_state_dict(m, opt)
    out = tmp_path / "old"
    dcp.save({"model": msd, "optim": osd, "rng": {"torch": torch.get_rng_state(), "python": json.dumps(random.getstate())},
              "extra": json.dumps({"iteration": 1})}, checkpoint_id=str(out))
    m.config.to_json_file(out / "config.json")
    (out / "extra.json").write_text(json.dumps({"iteration": 1}))
    write_manifest(out)
    assert any(k.startswith("model.") and "embed" in k for k in _saved_keys(out))
    live = m.state_dict()
    for loaded in (load_trainer_state(out, lr=1e-2, dtype=torch.bfloat16)[0], load_trainer_model(out, dtype=torch.bfloat16)):
        for n, t in loaded.state_dict().items():
            assert torch.equal(t.view(torch.uint8), live[n].view(torch.uint8)), n
