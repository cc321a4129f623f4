"""The stages on a device (``Run.device``), on the CPU here and, marked ``gpu``, on
CUDA: the in-memory weight transfer gives the engine the disk path gives, and a rollout leaves the
engine without decode state.

Transfer reference: the disk path a separate rollout server takes (``write_disk``: the public layout
with MXFP4 routed experts, then ``build_engine`` from it). The trainer's weights are made bf16-exact
first, because the public layout stores them in bf16: then both paths hold identical bytes (the
MXFP4 codes come from the same quantiser) and the logprobs along the engine's decode path must be
equal, bit for bit on the CPU. On CUDA the MoE combine accumulates with atomics, so two engines with
equal bytes differ by rounding: there the tolerance is rounding's."""

import dataclasses
import gc

import pytest
import torch
from prefect.logging import disable_run_logger

from k3core.artifacts import Artifact
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.model.cache import StaticDecodeState
from k3core.rl.mismatch import engine_logprobs
from k3core.rl.trainer_state import rng_state
from k3core.rl.weights import build_engine
from k3core.rollout.quantized import expert_format
from k3core.settings import RolloutSettings
from k3core.transfer import push_inprocess, write_disk
from k3core.rl import engines, trainers
from tasks.common import Run
from tasks.transfer import _blank_engine, transfer_weights

TINY = K3Config.preset("tiny")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs CUDA")])]
SEQS = [([1, 5, 9, 2], [7, 3, 3, 8, 1]), ([4, 4], [2, 9, 6]), ([11, 12, 13, 14, 15], [16, 17])]


def _trainer(seed: int, device: str) -> K3ForCausalLM:
    m = K3ForCausalLM(TINY)
    m.reset_parameters(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):  # AttnRes projections start at zero: make the cache matter
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    m.cast(torch.bfloat16).cast(torch.float32)  # bf16-exact fp32 weights (the fp32-kept ones unchanged)
    return m.to(device)


def _logprobs(engine) -> torch.Tensor:
    lp, _ = engine_logprobs(engine.model, SEQS, TINY.pad_token_id)
    return torch.cat(lp)


@pytest.mark.parametrize("device", DEVICES)
def test_in_memory_transfer_equals_the_disk_path(tmp_path, device):
    run = Run(str(tmp_path / "art"), f"xfer-{device}", device=device)
    engines.clear()
    trainers.clear()
    model = _trainer(3, device)
    trainers.put(run.run_id, trainers.LiveTrainer(1, model, None, {}, rng_state()))
    checkpoint = Artifact(kind="dcp", uri="file:///unused", path=str(tmp_path / "unused"), sha256="", version=1)
    with disable_run_logger():
        art = transfer_weights.fn(run, 0, checkpoint, True)
    mem = engines.get(run.run_id)
    assert art.version == mem.weight_version == 1 and art.uri == f"engine://{run.run_id}@v1"
    assert mem.device.type == device and expert_format(mem.model) == "w4a8"
    assert all(t.device.type == device for t in mem.model.state_dict().values())

    write_disk(tmp_path / "disk", model, TINY, 1, quantize_experts=True)
    disk = build_engine(tmp_path / "disk", 1, device=device)
    assert expert_format(disk.model) == "w4a8"
    for k, v in disk.model.state_dict().items():  # identical bytes: the two paths agree before any forward
        assert torch.equal(v, mem.model.state_dict()[k]), k
    got, want = _logprobs(mem), _logprobs(disk)
    if device == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    # the check can fail: the same push without the AttnRes refresh leaves the blank engine's zero cache
    stale = _blank_engine(TINY, torch.float32, True, device)
    push_inprocess(stale, model.state_dict(), 1, quantize_experts=True, refresh=False)
    assert (_logprobs(stale) - want).abs().max() > 1e-2
    engines.clear()
    trainers.clear()


def _static_states() -> int:
    gc.collect()
    return sum(type(o) is StaticDecodeState for o in gc.get_objects())


def test_rollout_stage_leaves_no_decode_state(tmp_path, monkeypatch):
    """The rollout stage on an engine in static decode (what CUDA uses; forced here on the CPU, whose
    default "dynamic" drops its cache with the batch anyway) ends with the decode state released:
    bytes were held during the rollout, none after, and no ``StaticDecodeState`` is alive."""
    from k3core.rollout.engine import RolloutEngine
    from tasks.fetch import fetch_checkpoint
    from tasks.quantize import quantize_mxfp4
    from tasks.rollout import rollout

    released = []
    real = RolloutEngine.release_decode_state
    monkeypatch.setattr(RolloutEngine, "release_decode_state", lambda self: released.append(real(self)) or released[-1])
    engines.clear()
    run = Run(str(tmp_path), "rel", env="add", decode="static")  # --decode static
    assert _static_states() == 0
    with disable_run_logger():
        weights = quantize_mxfp4.fn(run, fetch_checkpoint.fn(run, "init:tiny:1"))
        out = rollout.fn(run, 0, weights, RolloutSettings(prompts_per_iteration=2, samples_per_prompt=3,
                                                          max_new_tokens=4))
    eng = engines.get(run.run_id)
    assert out.info["rows"] == 6 and eng.decode_mode == "static"
    assert len(released) == 1 and released[0] > 0  # the state existed and was handed back
    assert eng.decode_state_bytes() == 0 and _static_states() == 0
    engines.clear()


def test_the_decode_setting_reaches_the_transferred_and_the_rollout_engine(tmp_path):
    """``--decode`` (``Run.decode``, resolved by ``Run.of``): the engine the transfer fills decodes in
    that mode, a rollout at the same version and mode takes that engine, and a rollout asking another
    mode gets a new one."""
    from tasks.rollout import engine_for

    run = Run(str(tmp_path / "art"), "decode-mode", decode="static")
    engines.clear()
    trainers.clear()
    trainers.put(run.run_id, trainers.LiveTrainer(1, _trainer(3, "cpu"), None, {}, rng_state()))
    checkpoint = Artifact(kind="dcp", uri="file:///unused", path=str(tmp_path / "unused"), sha256="", version=1,
                          info={"quantized": True})
    with disable_run_logger():
        transfer_weights.fn(run, 0, checkpoint, True)
    eng = engines.get(run.run_id)
    assert eng.decode_mode == "static"
    assert engine_for(run, checkpoint) is eng
    other = engine_for(dataclasses.replace(run, decode="dynamic"), checkpoint)
    assert other is not eng and other.decode_mode == "dynamic" and other.weight_version == 1
    engines.clear()
    trainers.clear()
