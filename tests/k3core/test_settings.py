"""The sectioned run settings: defaults in one place, one error listing every problem, nested and flat
construction agreeing, unknown settings refused (never silently ignored), and Prefect's parameter
validation (pydantic building the same dataclasses) giving the CLI's messages."""

import dataclasses
import re

import pytest

from k3core.settings import (
    GRPOSettings,
    ModelSettings,
    PipelineSettings,
    RLSettings,
    RolloutSettings,
    SettingsError,
    flag_index,
    section_fields,
)


def test_defaults_live_in_the_sections():
    s = RLSettings()
    assert s.model == ModelSettings(preset="small", source="init:small:0")
    assert s.grpo == GRPOSettings() and s.grpo.clip_eps_low == 0.2 and s.grpo.clip_eps_high == 0.28
    assert s.rollout.temperature == 1.0 and s.pipeline.iterations == 30
    # a fresh checkpoint follows the preset and seed when no source is given
    assert RLSettings.from_dict({"preset": "tiny", "seed": 7}).model.source == "init:tiny:7"
    assert RLSettings.from_dict({"preset": "tiny", "source": "file:///x"}).model.source == "file:///x"


def test_flags_are_unique_and_cover_every_field():
    flags = [f.metadata["flag"] for _, f in section_fields()]
    assert len(flags) == len(set(flags))
    index = flag_index()
    for sec, f in section_fields():
        assert index[f.metadata["flag"].replace("-", "_")] == (sec, f.name)


def test_nested_and_flat_agree():
    nested = RLSettings.from_dict({"model": {"preset": "tiny"}, "rollout": {"temperature": 0.7, "url": "local"},
                                   "warmup": {"steps": 0}, "pipeline": {"run_id": "x"}})
    flat = RLSettings.from_dict({"preset": "tiny", "temperature": 0.7, "rollout-url": "local", "warmup_steps": 0,
                                 "run_id": "x"})
    assert nested == flat
    assert RLSettings.from_dict(nested.to_dict()) == nested  # the recorded form reads back
    assert nested.replace(iterations=3).pipeline.iterations == 3 and nested.pipeline.iterations == 30


def test_every_problem_of_every_section_in_one_error():
    with pytest.raises(SettingsError) as e:
        RLSettings.from_dict({"preset": "huge", "iterations": -1, "top_p": 0.0, "lr": -1e-3, "run_id": "../up",
                              "samples_per_prompt": "eight", "quantized_rollouts": "yes", "bogus": 1})
    msg = str(e.value)
    assert msg.startswith("invalid settings (8 problems):")
    for needle in ("unknown preset 'huge'", "--iterations must be >= 0, got -1", "--top-p must lie in (0, 1]",
                   "--lr must be >= 0.0", "--run-id '../up'", "--samples-per-prompt must be an integer",
                   "--quantized-rollouts must be true or false", "unknown setting 'bogus'"):
        assert needle in msg, needle
    with pytest.raises(SettingsError, match="section 'rollout' has no setting 'tempreature'"):
        RLSettings.from_dict({"rollout": {"tempreature": 1.0}})


def test_a_section_validates_itself():
    with pytest.raises(SettingsError, match=r"invalid RolloutSettings \(2 problems\)"):
        RolloutSettings(temperature=-1.0, top_p=2.0)
    with pytest.raises(SettingsError, match="init:PRESET"):
        ModelSettings(source="init:tiny:x")
    with pytest.raises(SettingsError, match="--run-id"):
        PipelineSettings(run_id="a/b")
    with pytest.raises(SettingsError, match="section 'grpo' must be a GRPOSettings"):
        RLSettings(grpo={"lr": 1.0})


def test_prefect_parameter_validation_gives_the_same_messages():
    """A flow taking ``RLSettings``: pydantic builds the sections (``__post_init__`` runs) and refuses
    unknown keys, so a deployment run fails on the same problems the CLI reports."""
    from prefect import flow
    from prefect.exceptions import ParameterTypeError

    @flow
    def f(settings: RLSettings = RLSettings()):
        return settings

    ok = f.validate_parameters({"settings": {"rollout": {"temperature": 0.5}, "model": {"preset": "tiny"}}})["settings"]
    assert ok == RLSettings.from_dict({"temperature": 0.5, "preset": "tiny"})
    with pytest.raises(ParameterTypeError) as e:
        f.validate_parameters({"settings": {"rollout": {"temperature": -1, "top_p": 3}, "pipeline": {"iterations": -2}}})
    for needle in ("--temperature must be >= 0.0, got -1", "--top-p must lie in (0, 1], got 3",
                   "--iterations must be >= 0, got -2"):
        assert needle in str(e.value), needle
    with pytest.raises(ParameterTypeError, match="tempreature"):
        f.validate_parameters({"settings": {"rollout": {"tempreature": 1.0}}})
    with pytest.raises(ParameterTypeError, match="preset"):  # the old flat form is refused, not ignored
        f.validate_parameters({"settings": {"preset": "tiny"}})


def test_settings_are_plain_dataclasses():
    s = RLSettings()
    assert dataclasses.is_dataclass(s) and all(dataclasses.is_dataclass(getattr(s, n)) for n in s.to_dict())


def test_update_settings_defaults_flags_and_checks():
    """The minibatch-update settings: today's single on-policy update by default, one flag each, bad
    values listed together."""
    g = GRPOSettings()
    assert (g.ppo_epochs, g.minibatches, g.micro_batch_tokens, g.loss_aggregation, g.scale_advantages,
            g.refill_rounds, g.packing) == (1, 1, 8192, "token-mean", True, 0, True)
    s = RLSettings.from_dict({"ppo-epochs": 2, "minibatches": 4, "micro_batch_tokens": 2048,
                              "loss-aggregation": "seq-sum", "scale-advantages": False, "refill-rounds": 3,
                              "packing": False})
    assert (s.grpo.ppo_epochs, s.grpo.minibatches, s.grpo.micro_batch_tokens, s.grpo.loss_aggregation,
            s.grpo.scale_advantages, s.grpo.refill_rounds, s.grpo.packing) == (2, 4, 2048, "seq-sum", False, 3, False)
    with pytest.raises(SettingsError) as e:
        GRPOSettings(ppo_epochs=0, minibatches=0, micro_batch_tokens=-1, loss_aggregation="sum",
                     scale_advantages="no", refill_rounds=-1, packing="no")
    msg = str(e.value)
    for needle in ("--ppo-epochs must be >= 1, got 0", "--minibatches must be >= 1, got 0",
                   "--micro-batch-tokens must be >= 0, got -1", "--loss-aggregation: unknown mode 'sum'",
                   "--scale-advantages must be true or false", "--refill-rounds must be >= 0, got -1",
                   "--packing must be true or false"):
        assert needle in msg, needle


def test_grpo_bounds():
    with pytest.raises(SettingsError, match=r"--tis-cap must be > 0, got 0.0"):
        GRPOSettings(tis_cap=0.0)
    with pytest.raises(SettingsError, match=r"--clip-eps-low must be < 1"):
        GRPOSettings(clip_eps_low=1.0)
    with pytest.raises(SettingsError, match=r"--rollout-url 'ftp://x'"):
        RolloutSettings(url="ftp://x")


@pytest.mark.parametrize("flat, says", [
    (dict(max_staleness=2, refill_rounds=1), "--max-staleness 2 with --refill-rounds 1"),
    ({"task_runner": "ray", "rollout-url": "http://127.0.0.1:30000"}, "--task-runner ray runs rollouts on the Ray workers'"),
    (dict(train_procs=2, kl_coef=0.1), "--kl-coef with --train-procs > 1"),
])
def test_combinations_not_supported_yet_are_refused_naming_both_flags(flat, says):
    with pytest.raises(SettingsError, match=re.escape(says)):
        RLSettings.from_dict(flat)
    for key, value in flat.items():  # either flag alone is fine
        RLSettings.from_dict({key: value})


@pytest.mark.parametrize("runner", ["dask", "ray"])
def test_batches_ahead_on_workers_take_in_flight_drain_only(runner):
    """Rollout workers sample batches ahead (``--max-staleness``); an update reaching them mid-batch
    (``--in-flight continue|abort``, which acts on this process's engine) is refused."""
    RLSettings.from_dict(dict(task_runner=runner, max_staleness=2))
    with pytest.raises(SettingsError, match=re.escape(f"with --task-runner {runner} the batch sampled ahead runs on "
                                                      "the workers' engines")):
        RLSettings.from_dict(dict(task_runner=runner, max_staleness=1, in_flight="abort"))
