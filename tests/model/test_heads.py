"""Model-level behaviour: causal masking, padding, save/load through the Auto classes, building on a
target device/dtype, the fp32 residual stream under autocast, and apply_memory_options."""

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForPreTraining

from model import LeanAlbertForPreTraining, LeanGPTForCausalLM, LeanModel, LeanTransformerConfig, apply_memory_options
from model.layers import LeanFFN, LeanSelfAttention
from tests.support.model import VOCAB, randomize, small_config

SEQ = 16


def _ids(seed=0, batch=2):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _gpt(custom=True, **overrides):
    model = randomize(LeanGPTForCausalLM(small_config(**overrides)).double()).eval()
    return apply_memory_options(model, custom_ffn=custom, custom_attention=custom)


@pytest.mark.parametrize("custom", [True, False])
@pytest.mark.parametrize(
    "overrides",
    [{}, dict(reversible=True), dict(position_embedding_type="absolute")],
    ids=["default", "reversible", "absolute"],
)
def test_future_tokens_do_not_change_earlier_logits(custom, overrides):
    model = _gpt(custom, **overrides)
    ids = _ids()
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % VOCAB
    with torch.no_grad():
        logits, changed_logits = model(input_ids=ids).logits, model(input_ids=changed).logits
    assert torch.allclose(logits[:, :9], changed_logits[:, :9], rtol=0, atol=1e-12)
    assert not torch.allclose(logits[:, 9:], changed_logits[:, 9:])


@pytest.mark.parametrize("custom", [True, False])
@pytest.mark.parametrize("head", ["gpt", "albert"])
def test_padded_positions_do_not_change_other_positions(custom, head):
    if head == "gpt":
        model = _gpt(custom)
    else:
        model = randomize(LeanAlbertForPreTraining(small_config(attention_type="bidirectional")).double()).eval()
        apply_memory_options(model, custom_ffn=custom, custom_attention=custom)
    ids, mask = _ids(), torch.ones(2, SEQ, dtype=torch.long)
    mask[0, -4:] = 0
    mask[1, :5] = 0
    changed = ids.masked_fill(mask == 0, 7)
    with torch.no_grad():
        hidden = model.transformer(ids, mask).last_hidden_state
        changed_hidden = model.transformer(changed, mask).last_hidden_state
    real = mask.bool()
    assert torch.isfinite(hidden).all()
    assert torch.allclose(hidden[real], changed_hidden[real], rtol=0, atol=1e-12)


def test_right_padding_matches_the_unpadded_sequence():
    model = _gpt()
    ids, mask = _ids(), torch.ones(2, SEQ, dtype=torch.long)
    mask[0, 11:] = 0
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits[0, :11]
        alone = model(input_ids=ids[:1, :11]).logits[0]
    assert torch.allclose(padded, alone, rtol=0, atol=1e-12)


def test_labels_give_loss_without_logits_unless_asked():
    model = _gpt()
    ids = _ids()
    output = model(input_ids=ids, labels=ids)
    assert output.logits is None and output.loss.ndim == 0
    with_logits = model(input_ids=ids, labels=ids, return_logits=True)
    assert with_logits.logits.shape == (2, SEQ, VOCAB)
    expected = torch.nn.functional.cross_entropy(with_logits.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert torch.allclose(output.loss, expected)


def test_albert_outputs_mlm_and_sop_losses():
    model = LeanAlbertForPreTraining(small_config(attention_type="bidirectional", type_vocab_size=2))
    ids = _ids()
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    output = model(
        input_ids=ids, token_type_ids=torch.zeros_like(ids), labels=labels, sentence_order_label=torch.tensor([0, 1])
    )
    assert torch.allclose(output.loss, output.mlm_loss + output.sop_loss)
    assert output.sop_logits.shape == (2, 2) and output.prediction_logits is None
    assert model(input_ids=ids).prediction_logits.shape == (2, SEQ, VOCAB)


@pytest.mark.parametrize(
    "head,auto_class,overrides",
    [
        ("gpt", AutoModelForCausalLM, {}),
        ("gpt", AutoModelForCausalLM, dict(share_large_matrices=True, adapter_dim=4, block_size=8, reversible=True)),
        ("albert", AutoModelForPreTraining, dict(attention_type="bidirectional", num_hidden_groups=1)),
    ],
    ids=["gpt", "gpt_shared_pixelfly", "albert"],
)
def test_save_and_load_round_trip_through_auto_classes(tmp_path, head, auto_class, overrides):
    model_class = LeanGPTForCausalLM if head == "gpt" else LeanAlbertForPreTraining
    model = randomize(model_class(small_config(**overrides))).eval()
    model.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), LeanTransformerConfig)
    loaded = auto_class.from_pretrained(tmp_path).eval()
    assert type(loaded) is model_class
    ids = _ids()
    with torch.no_grad():
        expected, actual = model(input_ids=ids), loaded(input_ids=ids)
    logits = "logits" if head == "gpt" else "prediction_logits"
    assert torch.equal(getattr(expected, logits), getattr(actual, logits))
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight  # still tied
    assert isinstance(AutoModel.from_pretrained(tmp_path), LeanModel)


def test_build_on_meta_device_and_in_target_dtype():
    config = small_config()
    default_dtype = torch.get_default_dtype()
    meta = LeanGPTForCausalLM.build(config, device="meta")
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    bf16 = LeanGPTForCausalLM.build(config, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == default_dtype
    with pytest.raises(ValueError, match="floating point"):
        LeanGPTForCausalLM.build(config, dtype=torch.int64)


def _sublayer_input_dtypes(model, run):
    dtypes = []
    hooks = [
        module.register_forward_pre_hook(lambda module, args: dtypes.append(args[0].dtype))
        for module in model.modules()
        if isinstance(module, (LeanSelfAttention, LeanFFN))
    ]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return set(dtypes)


@pytest.mark.parametrize("custom", [True, False])
def test_fp32_residual_stream_with_bf16_weights(custom):
    torch.manual_seed(0)
    model = LeanGPTForCausalLM.build(small_config(fp32_residual=True), dtype=torch.bfloat16)
    apply_memory_options(model, custom_ffn=custom, custom_attention=custom)
    ids = _ids()
    losses = []
    dtypes = _sublayer_input_dtypes(model, lambda: losses.append(model(input_ids=ids, labels=ids).loss))
    assert dtypes == {torch.float32}
    losses[0].backward()
    assert torch.isfinite(losses[0]) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_fp32_residual_under_autocast_matches_plain_path():
    torch.manual_seed(0)
    model = LeanGPTForCausalLM(small_config(fp32_residual=True)).train()
    ids = _ids()
    losses = {}
    for custom in (True, False):
        apply_memory_options(model, custom_ffn=custom, custom_attention=custom)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dtypes = _sublayer_input_dtypes(
                model, lambda: losses.__setitem__(custom, model(input_ids=ids, labels=ids).loss)
            )
        assert dtypes == {torch.float32}
        losses[custom].backward()
    assert torch.allclose(losses[True], losses[False], rtol=1e-2)


def test_apply_memory_options_validates_and_keeps_unset_options():
    model = LeanGPTForCausalLM(small_config())
    assert apply_memory_options(model, custom_ffn=False) is model
    assert model.config.custom_ffn is False and model.config.custom_attention is True
    apply_memory_options(model, checkpoint_layers=True, loss_chunk_size=0)
    assert model.transformer.stack.checkpoint_layers and model.loss_chunk_size == 0
    with pytest.raises(ValueError, match="loss_chunk_size"):
        apply_memory_options(model, loss_chunk_size=-3)
    with pytest.raises(ValueError, match="custom_attention must be True, False or None"):
        apply_memory_options(model, custom_attention=1)
    reversible = LeanGPTForCausalLM(small_config(reversible=True))
    with pytest.raises(ValueError, match="reversible"):
        apply_memory_options(reversible, checkpoint_layers=True)
    with pytest.raises(ValueError, match="LayerStack"):
        apply_memory_options(torch.nn.Linear(2, 2), custom_ffn=True)


def test_reversible_backward_recomputes_under_the_forward_autocast_state():
    model = LeanGPTForCausalLM(small_config(reversible=True))
    ids = _ids()
    states = []
    hooks = [
        module.register_forward_pre_hook(lambda *_: states.append(torch.is_autocast_enabled("cpu")))
        for module in model.modules()
        if isinstance(module, (LeanSelfAttention, LeanFFN))
    ]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    forward_calls = len(states)
    loss.backward()
    for hook in hooks:
        hook.remove()
    assert len(states) == 2 * forward_calls and all(states)  # every sub-layer recomputed, under autocast
