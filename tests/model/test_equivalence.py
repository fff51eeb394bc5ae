"""Every memory path computes the same loss and gradients as the plain-autograd reference of the same
architecture (float64, relative error <= 1e-6): custom FFN/attention on and off, checkpointing, the
reversible stack (vs revlib with plain autograd), sharing, adapters, PixelFly, GeGLU, sandwich norm,
rotary/absolute positions, dropout with a fixed seed and padding."""

import pytest
import torch

from model import LeanAlbertForPreTraining, LeanGPTForCausalLM, apply_memory_options
from tests.support.model import VOCAB, assert_same_loss_and_grads, randomize, small_config, with_plain_reference

DROPOUT = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2)

ARCHITECTURES = {
    "default": {},
    "gelu_tanh": dict(hidden_act="gelu_tanh"),
    "relu": dict(hidden_act="relu"),
    "geglu": dict(gated_ffn=True),
    "swiglu": dict(gated_ffn=True, hidden_act="silu"),
    "sandwich": dict(norm_scheme="sandwich"),
    "absolute": dict(position_embedding_type="absolute"),
    "dropout": DROPOUT,
    "fp32_residual": dict(fp32_residual=True),
    "factorized_embedding": dict(embedding_size=16),
    "groups": dict(num_hidden_layers=4, num_hidden_groups=2),
    "shared": dict(share_large_matrices=True),
    "shared_adapters": dict(share_large_matrices=True, adapter_dim=4),
    "pixelfly": dict(block_size=8),
    "pixelfly_lowrank_geglu": dict(block_size=8, lowrank_dim=4, gated_ffn=True),
    "pixelfly_shared_adapters": dict(block_size=8, lowrank_dim=4, share_large_matrices=True, adapter_dim=4),
    "reversible": dict(reversible=True),
    "reversible_dropout_sandwich": dict(reversible=True, norm_scheme="sandwich", **DROPOUT),
    "reversible_shared_pixelfly": dict(reversible=True, block_size=8, share_large_matrices=True, adapter_dim=4),
    "everything": dict(
        gated_ffn=True,
        norm_scheme="sandwich",
        position_embedding_type="absolute",
        num_hidden_layers=4,
        num_hidden_groups=2,
        fp32_residual=True,
        **DROPOUT,
    ),
}

MEMORY_MODES = {
    "custom": dict(custom_ffn=True, custom_attention=True),
    "custom_ffn_only": dict(custom_ffn=True, custom_attention=False),
    "custom_attention_only": dict(custom_ffn=False, custom_attention=True),
    "checkpoint": dict(custom_ffn=True, custom_attention=True, checkpoint_layers=True),
    "checkpoint_plain_layers": dict(custom_ffn=False, custom_attention=False, checkpoint_layers=True),
}


def _batch(padded: bool, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
    mask = torch.ones_like(input_ids)
    if padded:
        mask[0, -5:] = 0  # right padding
        mask[1, :3] = 0  # left padding: its first queries see no key at all
    return dict(input_ids=input_ids, attention_mask=mask, labels=input_ids)


def _gpt(config, memory):
    model = randomize(LeanGPTForCausalLM(config).double())
    return apply_memory_options(model, **memory).train()


# checkpointing does not apply to a reversible stack (combining them raises, see test_model_heads.py)
COMBINATIONS = [
    (architecture, memory)
    for architecture in ARCHITECTURES
    for memory in MEMORY_MODES
    if not (ARCHITECTURES[architecture].get("reversible") and MEMORY_MODES[memory].get("checkpoint_layers"))
]


@pytest.mark.parametrize("architecture,memory", COMBINATIONS)
def test_gpt_matches_plain_reference(architecture, memory):
    config = small_config(**ARCHITECTURES[architecture])
    model, reference = with_plain_reference(_gpt(config, MEMORY_MODES[memory]))
    assert_same_loss_and_grads(
        model,
        reference,
        **_batch(padded=architecture in ("default", "dropout", "reversible_dropout_sandwich", "everything")),
    )


@pytest.mark.parametrize("architecture", ["default", "dropout", "reversible_dropout_sandwich", "absolute"])
def test_padded_batches_match_plain_reference(architecture):
    model, reference = with_plain_reference(_gpt(small_config(**ARCHITECTURES[architecture]), MEMORY_MODES["custom"]))
    assert_same_loss_and_grads(model, reference, **_batch(padded=True, seed=2))


@pytest.mark.parametrize("loss_chunk_size", [1, 5, 32, 4096])
def test_chunked_loss_matches_full_logits(loss_chunk_size):
    model = _gpt(small_config(), dict(loss_chunk_size=loss_chunk_size))
    model, reference = with_plain_reference(model)
    assert_same_loss_and_grads(model, reference, **_batch(padded=True))


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(reversible=True, **DROPOUT), dict(block_size=8, embedding_size=16)],
    ids=["default", "reversible_dropout", "pixelfly_factorized"],
)
def test_albert_matches_plain_reference(overrides):
    config = small_config(attention_type="bidirectional", type_vocab_size=2, **overrides)
    model, reference = with_plain_reference(randomize(LeanAlbertForPreTraining(config).double()).train())
    batch = _batch(padded=True)
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, 2:12:3] = batch["input_ids"][:, 2:12:3]
    token_type_ids = (torch.arange(16) >= 8).long().expand(2, 16)
    assert_same_loss_and_grads(
        model,
        reference,
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        token_type_ids=token_type_ids,
        labels=labels,
        sentence_order_label=torch.tensor([0, 1]),
    )


def test_dropout_is_active_and_seeded():
    model = _gpt(small_config(**DROPOUT), MEMORY_MODES["custom"])
    batch = _batch(padded=False)
    losses = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        losses.append(model(**batch).loss.item())
    model.eval()
    eval_loss = model(**batch).loss.item()
    assert losses[0] == losses[1] and losses[0] != losses[2] and eval_loss not in losses
