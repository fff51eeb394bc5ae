"""What the memory paths keep for backward (saved_tensors_hooks): custom attention keeps no (seq x seq)
tensor, custom FFN keeps only its input and pre-activation, checkpointing one hidden state per layer,
and the reversible stack nothing per layer."""

import pytest
import torch

from model import LeanGPTForCausalLM, apply_memory_options
from model.layers import LeanFFN, LeanSelfAttention
from model.ops.rotary import rotary_tables
from tests.support.model import SavedTensors, small_config

BATCH, SEQ, HIDDEN = 2, 24, 32  # all different, so shapes identify tensors


def _saved_by(module, *args):
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    with SavedTensors(exclude=list(module.parameters())) as saved:
        out = module(x, *args)
    out.sum().backward()  # outside the hooks: what backward recomputes and frees is not kept
    return x, saved


def _attention_args(padding: bool):
    rotary = rotary_tables(SEQ, HIDDEN // 4, 10000.0, "cpu", torch.float64)
    mask = None
    if padding:
        mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
        mask[0, -7:] = False
    return rotary, mask


@pytest.mark.parametrize(
    "options",
    [{}, dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1), dict(attention_type="bidirectional")],
    ids=["default", "dropout", "bidirectional"],
)
@pytest.mark.parametrize("padding", [False, True])
def test_custom_attention_saves_no_seq_by_seq_tensor(options, padding):
    config = small_config(**options)
    attention = LeanSelfAttention(config).double().train()
    rotary, mask = _attention_args(padding)
    x, saved = _saved_by(attention, rotary, mask)
    for shape in saved.shapes:
        assert shape.count(SEQ) <= 1, f"saved a (seq x seq) tensor of shape {shape}"
    # input + qkv + attention output (5 x hidden per token) + logsumexp + shared rotary tables / mask
    activation_bytes = BATCH * SEQ * 5 * HIDDEN * 8 + BATCH * 4 * SEQ * 8
    shared_bytes = sum(t.untyped_storage().nbytes() for t in (*rotary, *([mask] if padding else [])))
    assert saved.storage_bytes == activation_bytes + shared_bytes
    assert any(t is x for t in saved.tensors)

    attention.custom = False  # the plain path does keep the probabilities: the check above is meaningful
    _, plain = _saved_by(attention, rotary, mask)
    assert any(shape.count(SEQ) == 2 for shape in plain.shapes)


@pytest.mark.parametrize(
    "options", [{}, dict(gated_ffn=True), dict(hidden_dropout_prob=0.1)], ids=["gelu", "geglu", "dropout"]
)
def test_custom_ffn_saves_only_input_and_pre_activation(options):
    config = small_config(**options)
    ffn = LeanFFN(config).double().train()
    x, saved = _saved_by(ffn)
    pre_width = config.intermediate_size * (2 if config.gated_ffn else 1)
    assert len(saved.tensors) == 2 and saved.tensors[0] is x
    assert saved.shapes[1] == (BATCH, SEQ, pre_width)
    assert saved.storage_bytes == BATCH * SEQ * (HIDDEN + pre_width) * 8


def test_sandwich_ffn_also_saves_its_pre_norm_output():
    ffn = LeanFFN(small_config(norm_scheme="sandwich")).double()
    _, saved = _saved_by(ffn)
    assert saved.shapes[1:] == [(BATCH, SEQ, 64), (BATCH, SEQ, HIDDEN)]


def _saved_by_stack(num_layers: int, **options) -> SavedTensors:
    config = small_config(num_hidden_layers=num_layers, **options)
    model = LeanGPTForCausalLM(config).double()
    apply_memory_options(model, checkpoint_layers=options.get("checkpoint_layers"))
    stack = model.transformer.stack
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    rotary = rotary_tables(SEQ, HIDDEN // 4, 10000.0, "cpu", torch.float64)  # not saved by checkpoints
    with SavedTensors(exclude=list(model.parameters())) as saved:
        out = stack(x, rotary, None)
    out.sum().backward()
    return saved


def test_checkpointing_saves_one_hidden_state_per_layer():
    hidden_bytes = BATCH * SEQ * HIDDEN * 8
    for num_layers in (2, 4):
        saved = _saved_by_stack(num_layers, checkpoint_layers=True)
        assert saved.shapes.count((BATCH, SEQ, HIDDEN)) == num_layers
        assert saved.storage_bytes == num_layers * hidden_bytes


def test_reversible_saved_bytes_do_not_grow_with_depth():
    shallow, deep = _saved_by_stack(2, reversible=True), _saved_by_stack(8, reversible=True)
    assert deep.storage_bytes == shallow.storage_bytes <= 2 * BATCH * SEQ * HIDDEN * 8
    # while the same stack without reversible layers grows
    assert _saved_by_stack(4).storage_bytes > _saved_by_stack(2).storage_bytes


def test_chunked_loss_never_materialises_full_logits():
    vocab = 80  # unlike any other dimension
    config = small_config(vocab_size=vocab, loss_chunk_size=8)
    model = LeanGPTForCausalLM(config).double()
    input_ids = torch.randint(0, vocab, (BATCH, SEQ))
    largest = []
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    class Track(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if (
                    isinstance(tensor, torch.Tensor)
                    and tensor.shape[-1:] == (vocab,)
                    and tensor.untyped_storage().data_ptr() not in parameter_storages
                ):
                    largest.append(tensor.numel() // vocab)
            return out

    with Track():
        output = model(input_ids=input_ids, labels=input_ids)
        output.loss.backward()
    assert output.logits is None
    assert largest and max(largest) <= 8  # never more than one chunk of token logits at once
