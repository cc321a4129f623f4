"""``k3rl sglang-server``'s command line, parsed by SGLang's own argument parser (``ServerArgs.add_cli_args``),
and its refusal of a checkpoint SGLang would compute wrongly."""

from __future__ import annotations

import argparse
import shlex

import pytest

import sglang_cpu
from flows.cli import main
from k3core.config import K3Config, mxfp4_quantization_config
from k3core.rollout import sglang_fix
from k3core.rollout.sglang_serving import launch_command


def _sglang_parse(argv):
    sglang_cpu.install_cpu_stubs()
    from sglang.srt.server_args import ServerArgs

    assert argv[1:3] == ["-m", "sglang.launch_server"]
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p.parse_args(argv[3:])


@pytest.mark.parametrize("mxfp4", [False, True])
def test_launch_command_is_what_sglang_reads(tmp_path, mxfp4):
    cfg = K3Config.preset("serve-small")
    if mxfp4:
        cfg = cfg.replace(quantization_config=mxfp4_quantization_config())
    cfg.to_json_file(tmp_path / "config.json")
    argv, env = launch_command(tmp_path, port=30123, weight_version="7", extra=["--mem-fraction-static", "0.5"])
    ns = _sglang_parse(argv)
    assert ns.model_path == str(tmp_path) and ns.skip_tokenizer_init and ns.enable_return_routed_experts
    assert (ns.dtype, ns.host, ns.port, ns.weight_version) == ("bfloat16", "127.0.0.1", 30123, "7")
    assert ns.quantization == ("compressed-tensors" if mxfp4 else None)
    assert ns.mem_fraction_static == 0.5
    assert sglang_fix.FIX_NAME in env[sglang_fix.ENV].split(",")


def test_launcher_refuses_what_sglang_would_compute_wrongly(tmp_path, capsys):
    K3Config.preset("small").to_json_file(tmp_path / "config.json")
    with pytest.raises(ValueError, match="hidden_size 256 is not a multiple of 1024"):
        launch_command(tmp_path)
    assert main(["sglang-server", "--checkpoint", str(tmp_path)]) == 2
    assert "serve-small" in capsys.readouterr().err
    assert main(["sglang-server", "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_print_command(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(sglang_fix.ENV, raising=False)
    K3Config.preset("serve-small").to_json_file(tmp_path / "config.json")
    assert main(["sglang-server", "--checkpoint", str(tmp_path), "--print-command", "--", "--tp-size", "1"]) == 0
    env_part, cmd = capsys.readouterr().out.strip().split(" ", 1)
    assert env_part == f"{sglang_fix.ENV}={sglang_fix.FIX_NAME}"
    ns = _sglang_parse(shlex.split(cmd))
    assert ns.tp_size == 1 and ns.skip_tokenizer_init


def test_fix_is_off_unless_the_launcher_names_it(monkeypatch):
    monkeypatch.delenv(sglang_fix.ENV, raising=False)
    assert not sglang_fix.enabled() and not sglang_fix.register()
    monkeypatch.setenv(sglang_fix.ENV, "other," + sglang_fix.FIX_NAME)
    assert sglang_fix.enabled()
