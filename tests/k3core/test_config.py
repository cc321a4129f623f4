import json

import pytest

from k3core.config import K3Config, mxfp4_quantization_config


def test_release_defaults_schedule():
    c = K3Config()
    assert c.num_hidden_layers == 93
    mla = [i for i in range(93) if c.layer_type(i) == "mla"]
    assert len(mla) == 24 and mla[-2:] == [91, 92] and mla[0] == 3  # 1-based 4, ..., 92, 93
    assert sum(c.layer_type(i) == "kda" for i in range(93)) == 69
    assert c.moe_layers == list(range(1, 93))
    assert c.shared_expert_intermediate_size == 6144
    assert c.kda_a_log_public_size == 128


@pytest.mark.parametrize("name", ["tiny", "small", "medium", "full"])
def test_presets_valid_and_roundtrip_through_hf_json(name, tmp_path):
    c = K3Config.preset(name)
    c.to_json_file(tmp_path / "config.json")
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == "kimi_k3" and d["text_config"]["model_type"] == "kimi_linear"
    assert min(d["text_config"]["linear_attn_config"]["kda_layers"]) >= 1  # 1-based in the file
    assert K3Config.from_json_file(tmp_path / "config.json") == c


def test_tiny_preset_has_every_layer_kind():
    c = K3Config.preset("tiny")
    kinds = {c.layer_type(i) for i in range(c.num_hidden_layers)}
    assert kinds == {"kda", "mla"}
    assert not c.is_moe_layer(0) and len(c.moe_layers) >= 1
    assert c.num_attn_res_blocks >= 2


def test_small_preset_three_to_one():
    c = K3Config.preset("small")
    kda = sum(c.layer_type(i) == "kda" for i in range(c.num_hidden_layers))
    mla = sum(c.layer_type(i) == "mla" for i in range(c.num_hidden_layers))
    assert kda == 3 * mla


def test_invalid_config_lists_every_problem():
    with pytest.raises(ValueError) as e:
        K3Config.preset("tiny").replace(hidden_size=0, num_experts_per_token=99, hidden_act="gelu",
                                        kda_gate_lower_bound=1.0)
    msg = str(e.value)
    for needle in ["hidden_size", "num_experts_per_token", "hidden_act", "kda_gate_lower_bound", "4 problems"]:
        assert needle in msg


def test_layer_lists_must_partition_layers():
    with pytest.raises(ValueError, match="neither"):
        K3Config.preset("tiny").replace(full_attn_layers=[4], kda_layers=[1, 2])
    with pytest.raises(ValueError, match="both"):
        K3Config.preset("tiny").replace(full_attn_layers=[3, 4], kda_layers=[1, 2, 3])


def test_other_model_types_refused():
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        K3Config.from_hf_dict({"model_type": "llama"})
    with pytest.raises(ValueError, match="text_config"):
        K3Config.from_hf_dict({"model_type": "kimi_k3"})


def test_vision_config_kept_but_text_only(tmp_path):
    d = K3Config.preset("tiny").to_hf_dict()
    d["vision_config"] = {"model_type": "moonvit", "hidden_size": 8}
    c = K3Config.from_hf_dict(d)
    assert c.to_hf_dict()["vision_config"] == {"model_type": "moonvit", "hidden_size": 8}


def test_quantization_config_roundtrip():
    c = K3Config.preset("tiny").replace(quantization_config=mxfp4_quantization_config())
    assert K3Config.from_hf_dict(c.to_hf_dict()).quantization_config == mxfp4_quantization_config()
    with pytest.raises(ValueError, match="quantization_config"):
        K3Config.preset("tiny").replace(quantization_config={"quant_method": "gptq"})


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        K3Config.preset("huge")


def test_config_json_uses_the_keys_serving_engines_read():
    """SGLang's K3 reads ``latent_moe_use_norm`` (default false), picks float16 under ``--dtype auto``
    without a declared dtype, and looks for the MXFP4 ``format`` inside the config group."""
    c = K3Config.preset("tiny").replace(quantization_config=mxfp4_quantization_config())
    d = c.to_hf_dict()
    text = d["text_config"]
    assert text["latent_moe_use_norm"] is True and "use_routed_expert_norm" not in text
    assert d["torch_dtype"] == d["dtype"] == text["torch_dtype"] == text["dtype"] == "bfloat16"
    qc = text["quantization_config"]
    assert qc["format"] == qc["config_groups"]["group_0"]["format"] == "mxfp4-pack-quantized"
    from compressed_tensors.quantization import QuantizationConfig  # the peer library accepts the group

    assert QuantizationConfig.model_validate(qc).config_groups["group_0"].format == "mxfp4-pack-quantized"
    assert K3Config.from_hf_dict(d) == c
    off = K3Config.preset("tiny").replace(use_routed_expert_norm=False)
    assert K3Config.from_hf_dict(off.to_hf_dict()).use_routed_expert_norm is False


def test_routed_expert_norm_switch_names():
    d = K3Config.preset("tiny").to_hf_dict()
    text = d["text_config"]
    old = dict(text)
    old["use_routed_expert_norm"] = old.pop("latent_moe_use_norm")  # configs written before the rename
    assert K3Config.from_hf_dict({**d, "text_config": old}).use_routed_expert_norm is True
    with pytest.raises(ValueError, match="latent_moe_use_norm=True and use_routed_expert_norm=False"):
        K3Config.from_hf_dict({**d, "text_config": {**text, "use_routed_expert_norm": False}})
    missing = {k: v for k, v in text.items() if k != "latent_moe_use_norm"}
    with pytest.raises(ValueError, match="no latent_moe_use_norm"):
        K3Config.from_hf_dict({**d, "text_config": missing})


@pytest.mark.parametrize("key,value", [("moe_layer_freq", 2), ("rope_scaling", {"type": "yarn", "factor": 4.0}),
                                       ("sliding_window", 4096), ("attention_bias", True)])
def test_keys_that_change_the_computation_are_refused(key, value):
    d = K3Config.preset("tiny").to_hf_dict()
    with pytest.raises(ValueError, match=f"{key}="):
        K3Config.from_hf_dict({**d, "text_config": {**d["text_config"], key: value}})
    ok = K3Config.from_hf_dict({**d, "text_config": {**d["text_config"], "moe_layer_freq": 1, "rope_scaling": None}})
    assert ok == K3Config.preset("tiny")
