"""Config validation, presets and load_config."""

import json

import pytest
import torch

from model import LeanGPTForCausalLM, LeanTransformerConfig, available_presets, load_config

INVALID = [
    (dict(hidden_size=30), "divisible by num_attention_heads"),
    (dict(hidden_size=0), "hidden_size must be a positive integer"),
    (dict(num_hidden_layers=2.5), "num_hidden_layers must be a positive integer"),
    (dict(hidden_size=36, num_attention_heads=4), "even head dim"),
    (dict(hidden_act="swish"), "valid values: gelu, gelu_tanh, relu, silu"),
    (dict(attention_type="sparse"), "valid values: causal, bidirectional"),
    (dict(position_embedding_type="alibi"), "valid values: rotary, absolute"),
    (dict(norm_scheme="post"), "valid values: pre, sandwich"),
    (dict(hidden_dropout_prob=1.0), r"in \[0, 1\)"),
    (dict(attention_probs_dropout_prob=-0.1), r"in \[0, 1\)"),
    (dict(num_hidden_layers=4, num_hidden_groups=3), "multiple of num_hidden_groups"),
    (dict(adapter_dim=4), "needs share_large_matrices=True"),
    (dict(lowrank_dim=4), "set block_size > 0"),
    (dict(block_size=48), "block_size=48 does not fit"),
    (dict(block_size=-1), "block_size must be a non-negative integer"),
    (dict(reversible=True, checkpoint_layers=True), "pick one"),
    (dict(loss_chunk_size=-1), "loss_chunk_size must be a non-negative integer"),
    (dict(custom_ffn="yes"), "custom_ffn must be true or false"),
    (dict(layer_norm_eps=0), "layer_norm_eps must be a positive number"),
]


@pytest.mark.parametrize("overrides,message", INVALID, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(INVALID)])
def test_invalid_configs_raise_with_what_is_valid(overrides, message):
    with pytest.raises(ValueError, match=message):
        LeanTransformerConfig(**overrides)


def test_heads_check_attention_type():
    with pytest.raises(ValueError, match="LeanAlbertForPreTraining"):
        LeanGPTForCausalLM(LeanTransformerConfig(attention_type="bidirectional", hidden_size=32, intermediate_size=64))


def test_presets_load_and_validate():
    assert {"tiny", "small", "base", "large", "xl"} <= set(available_presets())
    for name in available_presets():
        assert isinstance(load_config(name), LeanTransformerConfig)
    tiny = load_config("tiny")
    assert tiny.vocab_size == 4096  # the shipped tokenizer's vocabulary


def test_xl_preset_has_gpt3_xl_size_on_meta_device():
    model = LeanGPTForCausalLM.build(load_config("xl"), device="meta")
    parameters = list(model.parameters())
    assert all(p.device.type == "meta" for p in parameters)
    assert 1.25e9 < sum(p.numel() for p in parameters) < 1.4e9


def test_tiny_preset_trains_a_step():
    torch.manual_seed(0)
    model = LeanGPTForCausalLM(load_config("tiny"))
    input_ids = torch.randint(0, 4096, (8, 128))
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_load_config_from_path_and_errors(tmp_path):
    path = tmp_path / "custom.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128}))
    assert load_config(path).hidden_size == 64
    assert load_config(str(path)).intermediate_size == 128
    with pytest.raises(ValueError, match="available presets: .*tiny"):
        load_config("huge")
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    path.write_text(json.dumps({"hiden_size": 64}))
    with pytest.raises(ValueError, match="unknown field.*hiden_size"):
        load_config(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(path)


def test_saved_config_json_loads_back(tmp_path):
    config = load_config("tiny")
    config.save_pretrained(tmp_path)
    assert load_config(tmp_path / "config.json").to_dict() == config.to_dict()
