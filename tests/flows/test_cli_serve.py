"""`k3rl serve`: with --checkpoint the rollout server (k3core.rollout.server.serve gets the options),
without it the Prefect deployments as before."""

import pytest

from flows.cli import build_parser, main


def test_serve_with_checkpoint_runs_the_rollout_server(monkeypatch, tmp_path):
    import k3core.rollout.server as server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda a: seen.setdefault("args", a) and 0)
    assert main(["serve", "--checkpoint", str(tmp_path), "--port", "31234", "--max-batch", "8"]) == 0
    a = seen["args"]
    assert (a.checkpoint, a.host, a.port, a.max_batch, a.dtype, a.experts) == (str(tmp_path), "127.0.0.1", 31234, 8,
                                                                              "float32", "auto")


def test_serve_without_checkpoint_still_serves_deployments(monkeypatch):
    a = build_parser().parse_args(["serve", "--limit", "2"])
    called = []
    monkeypatch.setattr(a, "serve_other", lambda args: called.append(args.limit) or 0, raising=False)
    assert a.fn(a) == 0 and called == [2]


def test_serve_with_a_missing_checkpoint_fails_clearly(tmp_path, capsys):
    assert main(["serve", "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err
