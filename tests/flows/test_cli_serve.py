"""`k3rl rollout-server --checkpoint DIR` starts the rollout HTTP server (its options reach
``cmd_rollout_server``); `k3rl serve` serves the Prefect deployments only, and refuses
``--checkpoint`` with a message naming `k3rl rollout-server`."""

import pytest

import flows.cli_serve as cli_serve
from flows.cli import build_parser, main


def test_rollout_server_gets_its_options(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli_serve, "cmd_rollout_server", lambda a: seen.setdefault("args", a) and 0)
    assert main(["rollout-server", "--checkpoint", str(tmp_path), "--port", "31234", "--max-batch", "8"]) == 0
    a = seen["args"]
    assert (a.checkpoint, a.host, a.port, a.max_batch, a.max_queue, a.dtype, a.experts, a.weight_version) == (
        str(tmp_path), "127.0.0.1", 31234, 8, 4096, "float32", "auto", 0)


def test_rollout_server_needs_a_checkpoint(capsys):
    with pytest.raises(SystemExit) as e:
        main(["rollout-server", "--port", "31234"])
    assert e.value.code == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_rollout_server_with_a_missing_checkpoint_fails_clearly(tmp_path, capsys):
    assert main(["rollout-server", "--checkpoint", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "no config.json" in err and "k3rl checkpoint init" in err


def test_serve_serves_the_deployments(monkeypatch):
    import flows.cli_deploy as cli_deploy

    a = build_parser().parse_args(["serve", "--limit", "2"])
    assert a.fn is cli_deploy.cmd_serve
    assert not hasattr(a, "port") and getattr(a, "checkpoint", None) is None


@pytest.mark.parametrize("argv", [["serve", "--checkpoint", "ckpt/"], ["serve", "--port", "30000", "--checkpoint=ckpt/"],
                                  ["serve", "--checkpoint"]])
def test_serve_refuses_a_checkpoint_and_names_rollout_server(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "k3rl rollout-server --checkpoint DIR" in err and "deployments" in err
