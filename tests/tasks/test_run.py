"""``Run.of``: a run's device, dtype and decode mode are resolved once, from the settings, into the
``Run`` every stage takes; "auto" has one meaning (``k3core.device.decode_mode``), and neither a
``Run`` nor an engine accepts an unresolved value. The run's paths are ``RunLayout``'s, the same
for the stages that publish them and the readers that find a run by its id."""

import pytest
import torch

from k3core.artifacts import Artifact
from k3core.rl.layout import RunLayout
from k3core.settings import RLSettings
from tasks.common import Run


def _settings(**kw) -> RLSettings:
    return RLSettings.from_dict({"artifacts": "/tmp/unused", "run_id": "r", **kw})


def test_auto_resolves_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = Run.of(_settings())
    assert (run.device, run.dtype, run.decode) == ("cpu", "float32", "dynamic")
    assert Run.of(_settings(decode="static", dtype="bfloat16")).decode == "static"
    with pytest.raises(ValueError, match="--decode graph replays CUDA graphs"):
        Run.of(_settings(decode="graph"))


def test_auto_resolves_on_cuda(monkeypatch):
    """With a GPU (patched in: nothing runs on it), ``auto`` is CUDA, bf16 and static decode; the CPU-only
    paths keep ``--device auto`` on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    run = Run.of(_settings())
    assert (run.device, run.dtype, run.decode) == ("cuda", "bfloat16", "static")
    assert Run.of(_settings(decode="graph")).decode == "graph"
    assert (Run.of(_settings(task_runner="dask")).device, Run.of(_settings(task_runner="dask")).decode) == (
        "cpu", "dynamic")


@pytest.mark.parametrize("field", [{"device": "auto"}, {"dtype": "auto"}, {"decode": "auto"}, {"device": "tpu"}])
def test_a_run_refuses_unresolved_values(field):
    with pytest.raises(ValueError, match=f"{next(iter(field))} .* is not resolved .*Run.of resolves"):
        Run("/tmp/unused", "r", **field)


def test_the_engine_takes_a_resolved_decode_mode():
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rollout.engine import RolloutEngine

    model = K3ForCausalLM(K3Config.preset("tiny"))
    assert RolloutEngine(model).decode_mode == "dynamic"
    with pytest.raises(ValueError, match="decode must be one of .*resolved.*got 'auto'"):
        RolloutEngine(model, decode="auto")


def test_stages_publish_where_the_readers_look(tmp_path):
    """The save stage's checkpoint and the train stage's trainer state are the paths retention deletes
    and resume reads (``RunLayout``), and ``latest.json`` is where ``k3rl status`` looks."""
    from k3core.settings import GRPOSettings, RolloutSettings
    from tasks.common import Batch
    from tasks.save import save_checkpoint
    from tasks.train import train_step

    run, layout = Run(str(tmp_path), "r"), RunLayout("r")
    state = Artifact("hf", "file:///unused", "/unused", "0" * 64, version=0)
    scored = Artifact("scored", run.uri(run.iter_rel(2, "scored.parquet")), "/unused", "1" * 64, version=2)
    task, _, _ = train_step.task(run, 2, state, Batch(RolloutSettings(), 0, (), (scored,)), GRPOSettings())
    assert [a.key for a in task.assets] == [run.uri(layout.trainer_rel(2))] == [(tmp_path / "runs/r/iter-0002/trainer").as_uri()]
    trained = Artifact("dcp", run.uri(layout.trainer_rel(2)), "/unused", "2" * 64, version=3)
    task, _, _ = save_checkpoint.task(run, 2, trained)
    assert [a.key for a in task.assets] == [(tmp_path / "runs/r/checkpoints/iter-0003").as_uri()]
    assert layout.checkpoint_rel(3) == "runs/r/checkpoints/iter-0003" and layout.latest == "runs/r/latest.json"
