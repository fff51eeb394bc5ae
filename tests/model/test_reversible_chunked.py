"""The reversible stack with chunked backward (model/reversible.py): the same loss and gradients as the
plain-autograd reversible reference in float64, and transient backward buffers that shrink with the chunk."""

import pytest
import torch

from model import LeanGPTForCausalLM, apply_memory_options
from peer import memlib
from tests.support.model import VOCAB, assert_same_loss_and_grads, randomize, small_config, with_plain_reference

DROPOUT = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2)

ARCHITECTURES = {
    "default": {},
    "sandwich_hidden_dropout": dict(norm_scheme="sandwich", hidden_dropout_prob=0.1),
    "dropout": DROPOUT,  # probability dropout: attention falls back to one chunk, FFN still chunked
    "shared_pixelfly": dict(block_size=8, share_large_matrices=True, adapter_dim=4),
    "geglu_fp32_residual_groups": dict(gated_ffn=True, fp32_residual=True, num_hidden_layers=4, num_hidden_groups=2),
    "absolute": dict(position_embedding_type="absolute"),
}
# (tokens, heads) per chunk: uneven splits on purpose (16 x 2 tokens, 4 heads)
CHUNKS = [(5, 0), (0, 1), (7, 3)]


def _batch():
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(input_ids)
    mask[0, -5:] = 0
    mask[1, :3] = 0
    return dict(input_ids=input_ids, attention_mask=mask, labels=input_ids)


@pytest.mark.parametrize("chunks", CHUNKS, ids=lambda c: f"tokens{c[0]}_heads{c[1]}")
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_chunked_reversible_matches_plain_reference(architecture, chunks):
    tokens, heads = chunks
    model = randomize(LeanGPTForCausalLM(small_config(reversible=True, **ARCHITECTURES[architecture])).double())
    apply_memory_options(model, reversible_chunk_tokens=tokens, reversible_chunk_heads=heads)
    assert_same_loss_and_grads(*with_plain_reference(model.train()), **_batch())


def test_chunked_reversible_with_plain_sublayers_matches_reference():
    model = randomize(LeanGPTForCausalLM(small_config(reversible=True, **DROPOUT)).double())
    apply_memory_options(
        model, custom_ffn=False, custom_attention=False, reversible_chunk_tokens=4, reversible_chunk_heads=2
    )
    assert_same_loss_and_grads(*with_plain_reference(model.train()), **_batch())


def _activation_peak(tokens: int, heads: int) -> int:
    torch.manual_seed(0)
    config = small_config(
        reversible=True, hidden_size=64, intermediate_size=512, num_attention_heads=8, loss_chunk_size=8, vocab_size=64
    )
    model = apply_memory_options(
        LeanGPTForCausalLM(config), reversible_chunk_tokens=tokens, reversible_chunk_heads=heads
    ).train()
    input_ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    return memlib.measured_step(model, input_ids).activation_peak_bytes


def test_chunked_backward_peak_shrinks_with_the_chunk():
    # revlib's whole-sub-layer backward vs chunks: the FFN's [tokens, 512] buffers dominate this size
    whole, chunked, finer = _activation_peak(0, 0), _activation_peak(32, 2), _activation_peak(8, 1)
    assert chunked < 0.6 * whole, (chunked, whole)
    assert finer <= chunked


def test_chunk_options_are_validated_and_recorded():
    model = LeanGPTForCausalLM(small_config(reversible=True))
    with pytest.raises(ValueError, match="reversible_chunk_heads must be a non-negative integer"):
        apply_memory_options(model, reversible_chunk_heads=-1)
    apply_memory_options(model, reversible_chunk_tokens=64)
    assert model.config.reversible_chunk_tokens == 64 and model.config.reversible_chunk_heads == 0
    with pytest.raises(ValueError, match="reversible_chunk_tokens"):
        small_config(reversible_chunk_tokens=1.5)


def test_chunked_backward_recomputes_under_the_forward_autocast_state():
    # recomputing in full precision would rebuild the streams from different sub-layer outputs
    ids = _batch()["input_ids"]
    grads = []
    for chunks in ((0, 0), (8, 2)):
        torch.manual_seed(0)
        model = LeanGPTForCausalLM(small_config(reversible=True))
        apply_memory_options(model, reversible_chunk_tokens=chunks[0], reversible_chunk_heads=chunks[1])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    chunked, whole = grads
    assert chunked.dtype == torch.float32
    assert ((chunked - whole).norm() / whole.norm()).item() < 0.02
