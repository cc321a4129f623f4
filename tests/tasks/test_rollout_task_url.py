"""The rollout stage through a rollout server (a real subprocess on 127.0.0.1): a server serving
another version is pushed the weights from disk (a public checkpoint as is, a trainer checkpoint
written with k3core.transfer.write_disk first), and the rollout table equals the embedded engine's."""


import pyarrow.parquet as pq
import pytest
import torch
from prefect.logging import disable_run_logger

from flows.cli_serve import launch
from k3core.checkpoint.hf import init_checkpoint, load_model
from k3core.rl.trainer_state import make_optimizer, save_trainer_state
from k3core.artifacts import Artifact
from k3core.settings import RolloutSettings
from k3core.rl import engines
from tasks.common import Run
from tasks.rollout import rollout


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("ro")
    init_checkpoint("tiny", root / "a", seed=0)
    init_checkpoint("tiny", root / "b", seed=1)
    proc, client = launch(root / "a", "--weight-version", "7", "--allow-version-rollback",  # 7, then 0
                          log_path=root / "server.log",
                          env={"OMP_NUM_THREADS": "1"}, timeout=60, retries=1, backoff=0.05)
    yield root, client
    proc.terminate()
    proc.wait(20)


def _run(root, weights, url, name):
    with disable_run_logger():
        out = rollout.fn(Run(str(root / "art" / name), "u", env="add", seed=0), 0, weights,
                         RolloutSettings(prompts_per_iteration=3, samples_per_prompt=2, max_new_tokens=5, url=url))
    return pq.read_table(out.path)


def test_rollout_through_a_server_equals_the_embedded_engine(served):
    root, client = served
    weights = Artifact("hf", "file:///b", str(root / "b"), "x", version=0)
    remote = _run(root, weights, client.target, "remote")
    assert client.weight_version() == 0  # pushed from disk: the server was at version 7
    engines.clear()
    local = _run(root, weights, "local", "local")
    engines.clear()
    for col in ("prompt_ids", "output_ids", "routing", "finish_reason", "weight_version"):
        assert remote.column(col).to_pylist() == local.column(col).to_pylist(), col
    lr = torch.tensor([x for r in remote.column("logprobs").to_pylist() for x in r])
    ll = torch.tensor([x for r in local.column("logprobs").to_pylist() for x in r])
    torch.testing.assert_close(lr, ll, rtol=0, atol=1e-5)


def test_a_trainer_checkpoint_is_written_and_pushed(served):
    root, client = served
    model = load_model(root / "b", dtype=torch.float32)
    save_trainer_state(root / "state", model, make_optimizer(model, 1e-3), {"iteration": 1})
    weights = Artifact("dcp", "file:///state", str(root / "state"), "x", version=1, info={"quantized": False})
    table = _run(root, weights, client.target, "dcp")
    assert client.weight_version() == 1 and set(table.column("weight_version").to_pylist()) == {1}
