"""Device selection (``--device cpu|cuda|auto``) and the per-stage memory probe, on the CPU.

``cuda`` where torch sees no GPU is refused before any work with exit status 2; torch's
``is_available`` is patched to False so these hold on a GPU machine too. The probe's host peak is
checked against allocations of known size, and its reset against a later stage that allocates
nothing."""

import time

import pytest
import torch

from flows.cli import main
from k3core import device as D
from k3core.settings import RLSettings, SettingsError

MiB = 2**20


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_and_auto_resolve_to_cpu_without_a_gpu(no_cuda):
    assert D.resolve_device("cpu") == torch.device("cpu")
    assert D.resolve_device("auto") == torch.device("cpu")
    assert D.run_device(RLSettings()).type == "cpu"  # the default is auto
    assert D.decode_mode("cpu") == "dynamic" and D.decode_mode("cuda") == "static"


def test_decode_setting_picks_the_engine_mode_and_graph_needs_cuda(no_cuda):
    assert [D.decode_mode("cuda", m) for m in ("auto", "dynamic", "static", "graph")] == \
        ["static", "dynamic", "static", "graph"]
    assert D.decode_mode("cpu", "static") == "static"
    with pytest.raises(ValueError, match=r"--decode graph replays CUDA graphs.*--device cuda.*--decode auto"):
        D.decode_mode("cpu", "graph")
    # --device auto on a machine without a GPU resolves to the CPU, where graph is refused up front
    with pytest.raises(ValueError, match="--decode graph"):
        D.decode_mode(D.run_device(RLSettings.from_dict({"rollout": {"decode": "graph"}})), "graph")
    with pytest.raises(SettingsError, match=r"--decode graph replays CUDA graphs.*--device cuda"):
        RLSettings.from_dict({"rollout": {"decode": "graph"}, "device": {"type": "cpu"}})
    with pytest.raises(SettingsError, match=r"--decode: unknown decode mode 'fast'"):
        RLSettings.from_dict({"rollout": {"decode": "fast"}})


def test_cuda_without_a_gpu_is_refused_naming_the_fix(no_cuda):
    with pytest.raises(D.DeviceUnavailable, match=r"--device cuda: torch sees no CUDA device.*--device cpu"):
        D.resolve_device("cuda")
    with pytest.raises(ValueError, match="must be one of"):
        D.resolve_device("gpu")


def test_auto_stays_on_the_cpu_for_cpu_only_paths(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert D.run_device(RLSettings.from_dict({"device": "auto"})).type == "cuda"
    assert D.run_device(RLSettings.from_dict({"device": "auto", "train_procs": 2})).type == "cpu"
    assert D.run_device(RLSettings.from_dict({"device": "auto", "task_runner": "dask"})).type == "cpu"
    assert D.run_device(RLSettings.from_dict({"device": "auto", "task_runner": "ray"})).type == "cpu"


def test_device_setting_flat_nested_and_refusals():
    assert RLSettings.from_dict({"device": "cpu"}).device.type == "cpu"
    assert RLSettings.from_dict({"device": {"type": "cuda"}}).device.type == "cuda"  # a deployment's parameter
    assert RLSettings().device.type == "auto"
    with pytest.raises(SettingsError, match="--device: unknown device 'gpu'"):
        RLSettings.from_dict({"device": "gpu"})
    with pytest.raises(SettingsError, match="dask") as e:
        RLSettings.from_dict({"device": "cuda", "task_runner": "dask", "train_procs": 2})
    assert "--train-procs" in str(e.value)  # every problem in one error
    with pytest.raises(SettingsError, match="--device cuda with --task-runner ray: the Ray workers' resident engines"):
        RLSettings.from_dict({"device": "cuda", "task_runner": "ray"})


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "--device cuda: torch sees no CUDA device"),
    (["--device", "gpu"], "--device: unknown device 'gpu'"),
])
def test_cli_refuses_with_exit_2_before_any_work(no_cuda, tmp_path, capsys, argv, message):
    rc = main(["run", "--preset", "tiny", "--run-id", "r", "--artifacts", str(tmp_path), *argv])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing started


def test_a_tick_computes_on_the_device_it_is_given(tmp_path):
    from flows.deploy import resolve_settings

    first, _ = resolve_settings("r", str(tmp_path), RLSettings.from_dict({"device": "cpu", "preset": "tiny"}))
    later, warnings = resolve_settings("r", str(tmp_path), RLSettings.from_dict({"device": "cuda", "preset": "tiny"}))
    assert first.device.type == "cpu" and later.device.type == "cuda"
    assert not warnings  # the device is free to change; the recorded settings still win otherwise


def _touch(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)  # resident, not only reserved
    return t


def test_probe_host_peak_is_per_stage():
    with D.MemoryProbe("cpu") as big:
        t = _touch(256 * MiB)
        del t
    with D.MemoryProbe("cpu") as small:
        _touch(MiB)
    assert big.peak.host_rss_method == "vmhwm"  # Linux: the kernel's high-water mark, reset per stage
    assert big.peak.device_peak_bytes == 0 and big.peak.device_bytes_after == 0
    # the second stage's peak does not carry the first's 256 MiB
    assert big.peak.host_rss_peak_bytes - small.peak.host_rss_peak_bytes > 200 * MiB


def test_probe_sampled_fallback_sees_a_peak_freed_before_the_end(monkeypatch):
    monkeypatch.setattr(D, "_reset_vmhwm", lambda: False)
    import psutil

    base = psutil.Process().memory_info().rss
    with D.MemoryProbe("cpu") as probe:
        t = _touch(256 * MiB)
        time.sleep(20 * D.MemoryProbe.SAMPLE_SECONDS)  # held for many sampling periods
        del t
    assert probe.peak.host_rss_method == "sampled"
    assert probe.peak.host_rss_peak_bytes - base > 200 * MiB


def test_merged_keeps_larger_peaks_and_later_residue():
    a, b = D.StagePeak(10, 5, 100, "vmhwm"), D.StagePeak(7, 3, 200, "vmhwm")
    assert a.merged(b) == D.StagePeak(10, 3, 200, "vmhwm")
