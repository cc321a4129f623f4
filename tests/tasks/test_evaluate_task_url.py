"""Held-out evaluation through a rollout server (a real subprocess on 127.0.0.1): the server is pushed
the weights of the version asked for, and every metric equals the embedded engine's on the same
weights (each sample goes with the seed the local engine gives it, so the samples are the same; the
weights used here are bf16-representable, so the public layout the server reads loses nothing). A
server or a checkpoint at another weight version is refused with an error naming both versions."""

import sys
from pathlib import Path

import pytest
import torch
from prefect.logging import disable_run_logger

from flows.cli_serve import launch
from k3core.rl.prompting import PromptFormat
from k3core.checkpoint.hf import init_checkpoint, load_model, save_hf
from k3core.rl.data import heldout_prompts
from k3core.rl.envs import load_env
from k3core.rl.evaluate import evaluate as stage_evaluate
from k3core.rl.trainer_state import make_optimizer, save_trainer_state
from k3core.rollout.client import WeightUpdateRefused, WeightVersionMismatch
from k3core.tokenizer import ByteTokenizer
from k3core.transfer import write_disk
from k3core.artifacts import Artifact
from k3core.settings import RolloutSettings
from k3core.rl import engines, trainers
from tasks.common import Run
from tasks.evaluate import evaluate

ENV_MODULE = "even_bytes_env_for_eval_tests"
ENV = f"{ENV_MODULE}:make"
# the even-bytes environment of tests/even_bytes_env.py, under this test file's own module name
ENV_SRC = (Path(__file__).resolve().parents[1] / "even_bytes_env.py").read_text()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A W4A8 server (MXFP4 checkpoint a, version 7) and the checkpoints b the tests evaluate."""
    root = tmp_path_factory.mktemp("ev")
    (root / f"{ENV_MODULE}.py").write_text(ENV_SRC)
    sys.path.insert(0, str(root))
    for name, seed in (("a", 0), ("b", 1)):
        init_checkpoint("tiny", root / name, seed=seed)
        save_hf(load_model(root / name, dtype=torch.float32), root / f"{name}-mx", target="mxfp4")
    proc, client = launch(root / "a-mx", "--weight-version", "7", "--allow-version-rollback",  # versions in any order
                          log_path=root / "server.log",
                          env={"OMP_NUM_THREADS": "1"}, timeout=60, retries=1, backoff=0.05)
    yield root, client
    proc.terminate()
    proc.wait(20)
    sys.path.remove(str(root))


def _eval(weights, url, seed=3):
    engines.clear()
    trainers.clear()
    try:
        with disable_run_logger():
            return evaluate.fn(Run("unused", "ev", env=ENV, seed=seed), "test", weights, 6,
                               RolloutSettings(max_new_tokens=5, temperature=1.0, url=url))
    finally:
        engines.clear()


def test_evaluation_through_a_server_equals_the_embedded_engine(served):
    root, client = served
    weights = Artifact("hf-mxfp4", "file:///b-mx", str(root / "b-mx"), "x", version=0)
    remote = _eval(weights, client.target)
    assert client.weight_version() == 0  # pushed from disk: the server was at version 7
    local = _eval(weights, "local")
    assert remote == local, (remote, local)
    assert remote["version"] == 0 and remote["heldout_n"] == 6 * 4
    assert 0.0 < remote["heldout_reward"] < 1.0  # the metric sees the samples...
    assert _eval(weights, client.target, seed=4)["heldout_reward"] != remote["heldout_reward"]  # ...and the seed


def test_a_quantised_trainer_state_evaluates_the_same_through_a_server(served):
    root, client = served
    model = load_model(root / "b", dtype=torch.float32)  # bf16 values: the disk layout stores them exactly
    save_trainer_state(root / "state", model, make_optimizer(model, 1e-3), {"iteration": 2})
    weights = Artifact("dcp", "file:///state", str(root / "state"), "x", version=2, info={"quantized": True})
    remote = _eval(weights, client.target)
    assert client.weight_version() == 2
    local = _eval(weights, "local")
    assert remote == local, (remote, local)
    assert 0.0 < remote["heldout_reward"] < 1.0


def test_a_server_at_another_version_is_refused(served):
    root, client = served
    client.update_weights_from_disk(str(root / "b-mx"), 5)
    env, tok = load_env(ENV), ByteTokenizer(load_model(root / "b", dtype=torch.float32).config)
    prompts = heldout_prompts(env, 0, 2, ENV)
    with pytest.raises(WeightVersionMismatch, match=r"serves weight version 5, the caller expects 6"):
        stage_evaluate(client, PromptFormat.of(tok, mode="raw"), env, ENV, prompts, 3, 1.0, expected_version=6)


def test_a_checkpoint_declaring_another_version_is_refused(served, tmp_path):
    """The evaluate task asks for version 4 of a directory that ``write_disk`` published as version 3:
    the server refuses the push and keeps serving what it had; nothing is evaluated."""
    root, client = served
    client.update_weights_from_disk(str(root / "b-mx"), 1)
    write_disk(tmp_path / "w", load_model(root / "a", dtype=torch.float32), version=3, quantize_experts=True)
    weights = Artifact("hf-mxfp4", "file:///w", str(tmp_path / "w"), "x", version=4)
    with pytest.raises(WeightUpdateRefused, match="version"):
        _eval(weights, client.target)
    assert client.weight_version() == 1
