"""Per-block gradient scaling (model/grad_scaling.py + peer/grad_scaling.py).

* float64: with power-of-two factors the loss is unchanged and the unscaled gradients are bit-identical to
  scaling off, for plain, custom, checkpointed, grouped and reversible (revlib) stacks;
* an overflow in one branch flags and zeroes that block only; the scaler halves only its factor;
* CPU fp16 autocast, a deep model whose blocks' gradients lie 2^30 apart: torch's global GradScaler keeps
  skipping steps (and the small blocks' gradients underflow to zero at any scale it can use), per-block
  scaling skips none and its unscaled gradients match the fp32 reference to fp16 rounding everywhere;
* the refused combinations and the trainer flag's validation.
"""

from __future__ import annotations

import copy

import pytest
import torch

from model import LeanGPTForCausalLM, apply_memory_options, block_grad_scales
from peer.grad_scaling import BlockScalePolicy, PerBlockGradScaler
from tests.support.model import loss_and_grads, randomize, relative_error, small_config

ARCHITECTURES = {
    "custom": (dict(), dict(custom_ffn=True, custom_attention=True)),
    "plain": (dict(), dict(custom_ffn=False, custom_attention=False)),
    "checkpoint": (dict(), dict(checkpoint_layers=True)),
    "groups_sandwich_dropout": (
        dict(num_hidden_layers=4, num_hidden_groups=2, norm_scheme="sandwich", hidden_dropout_prob=0.1),
        dict(custom_ffn=True, custom_attention=True),
    ),
    "reversible": (dict(reversible=True), dict(custom_ffn=True, custom_attention=True)),
    "reversible_plain": (dict(reversible=True), dict(custom_ffn=False, custom_attention=False)),
}


def _batch():
    input_ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(input_ids)
    mask[0, -5:] = 0
    return dict(input_ids=input_ids, attention_mask=mask, labels=input_ids)


def _scaled_loss_and_grads(model, factors, batch):
    """Backward with the given block factors (the loss times block 0's); raw (still scaled) gradients by name."""
    block_grad_scales(model).set_factors(factors)
    torch.manual_seed(0)  # the same dropout seeds as loss_and_grads
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    (loss * factors[0]).backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _block_of(model):
    """Parameter name -> block index."""
    groups = block_grad_scales(model).parameter_groups(model)
    index = {id(p): block for block, params in enumerate(groups) for p in params}
    return {name: index[id(p)] for name, p in model.named_parameters()}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_unscaled_gradients_are_exact_in_float64(architecture):
    overrides, memory = ARCHITECTURES[architecture]
    reference = apply_memory_options(randomize(LeanGPTForCausalLM(small_config(**overrides)).double()), **memory)
    model = apply_memory_options(copy.deepcopy(reference), per_block_grad_scaling=True).train()
    reference.train()
    batch = _batch()
    ref_loss, ref_grads = loss_and_grads(reference, **batch)
    blocks = len(block_grad_scales(model))
    assert blocks == 1 + 2 * len(model.transformer.stack.groups)
    # far apart on purpose: a factor that reached the wrong parameters would show
    factors = torch.tensor([2.0**e for e in (10, -7, 23, 0, -30, 15, 4, -2, 9)[:blocks]], dtype=torch.float64)
    loss, grads = _scaled_loss_and_grads(model, factors, batch)
    assert loss == ref_loss
    block_of = _block_of(model)
    assert set(block_of.values()) == set(range(blocks))  # every block reaches parameters
    for name, grad in grads.items():
        factor = factors[block_of[name]].double()
        assert relative_error(grad / factor, ref_grads[name]) <= 1e-12, name
        if ref_grads[name].abs().max() > 0:
            assert relative_error(grad, ref_grads[name] * factor) <= 1e-12, name  # really scaled by its factor
    assert not block_grad_scales(model).found_inf.any()


def test_scaler_unscales_to_the_reference_and_off_restores_the_model():
    reference = randomize(LeanGPTForCausalLM(small_config(norm_scheme="sandwich")).double()).train()
    model = apply_memory_options(copy.deepcopy(reference), per_block_grad_scaling=True)
    scaler = PerBlockGradScaler(model, BlockScalePolicy(init_scale=2.0**20))
    batch = _batch()
    ref_loss, ref_grads = loss_and_grads(reference, **batch)
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    scaler.scale(model(**batch).loss).backward()
    report = scaler.unscale_()
    assert report.overflowed == [] and report.grown == []
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[name]), name
    apply_memory_options(model, per_block_grad_scaling=False)
    assert block_grad_scales(model) is None
    loss, grads = loss_and_grads(model, **batch)
    assert loss == ref_loss and all(torch.equal(grads[name], ref_grads[name]) for name in grads)


def test_an_overflow_zeroes_and_backs_off_only_its_block():
    # float32: a factor of 2^200 overflows the branch's gradients as fp16 overflows at a too large scale
    model = randomize(LeanGPTForCausalLM(small_config(num_hidden_layers=3))).train()
    apply_memory_options(model, per_block_grad_scaling=True)
    reference = copy.deepcopy(model)
    apply_memory_options(reference, per_block_grad_scaling=False)
    _, ref_grads = loss_and_grads(reference, **_batch())
    scaler = PerBlockGradScaler(model, BlockScalePolicy(init_scale=1.0, max_scale=2.0**200))
    names = scaler.names
    hot = names.index("groups.1.ffn")
    scaler.scales[hot] = 2.0**200
    scaler.discard_step()  # hands the factors to the model
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    scaler.scale(model(**_batch()).loss).backward()
    assert block_grad_scales(model).found_inf.tolist() == [index == hot for index in range(len(names))]
    report = scaler.unscale_()
    assert report.overflowed == ["groups.1.ffn"]
    assert scaler.scales[hot] == 2.0**199 and all(s == 1.0 for i, s in enumerate(scaler.scales) if i != hot)
    block_of = _block_of(model)
    for name, p in model.named_parameters():
        block = names[block_of[name]]
        if block == "groups.1.ffn":
            assert not p.grad.any(), name  # skipped this step
        elif block in ("groups.1.attention", "outside") or block.startswith("groups.0."):
            # below the hot branch: finite, only the hot branch's contribution is missing (filtered to zero)
            assert torch.isfinite(p.grad).all(), name
        else:  # above it (groups.2.*): untouched by the overflow
            assert torch.equal(p.grad, ref_grads[name]), name


def test_policy_grows_after_clean_steps_within_headroom_and_validates():
    model = apply_memory_options(LeanGPTForCausalLM(small_config()), per_block_grad_scaling=True)
    scaler = PerBlockGradScaler(model, BlockScalePolicy(init_scale=2.0**4, growth_interval=2, max_scale=2.0**5))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    big = block_grad_scales(model).parameter_groups(model)[1][0]
    grown = []
    for _ in range(4):
        for p in model.parameters():
            p.grad.fill_(1e-3)
        big.grad.fill_(10000.0)  # block 1's largest scaled gradient: doubled, with headroom 4, past fp16's 65504
        grown.append(scaler.unscale_().grown)
    assert grown[0] == [] and grown[2] == []
    assert set(grown[1]) == set(scaler.names) - {"groups.0.attention"}
    assert grown[3] == []  # max_scale reached
    assert scaler.scales[1] == 2.0**4 and scaler.scales[0] == 2.0**5
    with pytest.raises(ValueError, match="power of two"):
        BlockScalePolicy(init_scale=1000.0)
    with pytest.raises(ValueError, match="growth_interval"):
        BlockScalePolicy(growth_interval=0)
    with pytest.raises(ValueError, match="per_block_grad_scaling=True"):
        PerBlockGradScaler(LeanGPTForCausalLM(small_config()))


def test_refused_combinations_say_how_to_fix():
    with pytest.raises(ValueError, match="share_large_matrices"):
        apply_memory_options(LeanGPTForCausalLM(small_config(share_large_matrices=True)), per_block_grad_scaling=True)
    reversible = LeanGPTForCausalLM(small_config(reversible=True))
    with pytest.raises(ValueError, match="reversible_chunk_tokens and reversible_chunk_heads"):
        apply_memory_options(reversible, per_block_grad_scaling=True, reversible_chunk_tokens=4)
    apply_memory_options(reversible, reversible_chunk_tokens=0, per_block_grad_scaling=True)
    with pytest.raises(ValueError, match="chunked reversible backward"):
        apply_memory_options(reversible, reversible_chunk_heads=2)


# ---- fp16: a deep model whose blocks need scales 2^30 apart --------------------------------------------------


def _deep_model_with_far_apart_blocks() -> LeanGPTForCausalLM:
    """6 layers (12 blocks), sandwich norm: the first three layers' output norms scaled by 2^10 and the last
    three's by 2^-20 put the last blocks' gradients about 2^30 below the first ones' (measured: max |grad|
    about 1 vs 5e-7, medians 1e-3 vs 1e-11), more than fp16 spans at one scale."""
    torch.manual_seed(0)
    model = LeanGPTForCausalLM(small_config(num_hidden_layers=6, norm_scheme="sandwich", loss_chunk_size=0))
    with torch.no_grad():
        for index, layer in enumerate(model.transformer.stack.groups):
            for sub in (layer.attention, layer.ffn):
                sub.sandwich_norm.weight.mul_(2.0**10 if index < 3 else 2.0**-20)
    return model


def _fp16_loss(model, input_ids):
    with torch.autocast("cpu", dtype=torch.float16):
        return model(input_ids=input_ids, labels=input_ids).loss


STEPS = 30


def test_fp16_global_scaler_keeps_skipping_per_block_does_not_and_matches_fp32():
    base = _deep_model_with_far_apart_blocks()
    batches = torch.randint(0, 64, (STEPS, 4, 32), generator=torch.Generator().manual_seed(1))

    # torch's global loss scaler (the policy hivemind.GradScaler inherits), growth checked every step
    global_model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(global_model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    global_skipped = []
    for input_ids in batches:
        optimizer.zero_grad()
        scaler.scale(_fp16_loss(global_model, input_ids)).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        global_skipped.append(scaler.get_scale() < before)

    model = apply_memory_options(copy.deepcopy(base), per_block_grad_scaling=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    block_scaler = PerBlockGradScaler(model, BlockScalePolicy(init_scale=2.0**16, growth_interval=1))
    overflows = []
    for input_ids in batches:
        optimizer.zero_grad()
        block_scaler.scale(_fp16_loss(model, input_ids)).backward()
        overflows.append(block_scaler.unscale_().overflowed)
        optimizer.step()

    half = STEPS // 2
    assert sum(global_skipped[half:]) >= half // 3, global_skipped  # still skipping long after the start
    assert not any(len(blocks) == len(block_scaler.names) for blocks in overflows)  # never a whole step
    assert sum(len(blocks) for blocks in overflows) <= 2 and not any(overflows[half:]), overflows
    scales = block_scaler.scales
    assert min(scales[-6:]) >= 2.0**14 * max(scales[1:7])  # the small blocks found their own range

    # the gradients at the same weights: fp32 reference, per-block fp16, global fp16 at its best scale
    input_ids = batches[-1]
    reference = copy.deepcopy(model)
    apply_memory_options(reference, per_block_grad_scaling=False)
    reference.zero_grad()
    reference(input_ids=input_ids, labels=input_ids).loss.backward()
    model.zero_grad()
    block_scaler.scale(_fp16_loss(model, input_ids)).backward()
    assert block_scaler.unscale_().overflowed == []
    worst = max(relative_error(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters()))
    assert worst <= 2e-2, worst  # fp16 rounding (measured 7e-3), on every parameter of every block

    global_grads = _best_global_scale_grads(reference, input_ids)
    global_worst = max(relative_error(g, r.grad) for g, r in zip(global_grads, reference.parameters()))
    assert global_worst >= 0.9, global_worst  # some block's gradients underflow (mostly zeros) at any safe scale


def _best_global_scale_grads(reference, input_ids):
    """Unscaled fp16 gradients at the largest global power-of-two scale that does not overflow."""
    model = copy.deepcopy(reference)
    for exponent in range(24, -24, -1):
        model.zero_grad()
        (_fp16_loss(model, input_ids) * 2.0**exponent).backward()
        grads = [p.grad / 2.0**exponent for p in model.parameters()]
        if all(torch.isfinite(g).all() for g in grads):
            return grads
    raise AssertionError("no global scale without overflow")


# ---- the trainer flag --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(per_block_grad_scaling=True), "needs --precision fp16"),
        (dict(per_block_grad_scaling=True, precision="bf16"), "needs --precision fp16"),
        (dict(per_block_grad_scaling=True, precision="fp16", reversible_chunk_heads=2), "chunked reversible"),
        (dict(grad_scale_growth_interval=0), "grad_scale_growth_interval"),
    ],
)
def test_trainer_flag_is_validated(fields, message):
    from peer.swarm.config import TrainingArguments

    with pytest.raises(ValueError, match=message):
        TrainingArguments(**fields)


def test_trainer_checks_the_model_before_joining(tmp_path):
    import json

    from peer.model_setup import check_memory_options
    from peer.swarm.config import TrainingArguments

    path = tmp_path / "shared.json"
    path.write_text(json.dumps(small_config(share_large_matrices=True).to_diff_dict()))
    args = TrainingArguments(model_config=str(path), per_block_grad_scaling=True, precision="fp16")
    with pytest.raises(ValueError, match="share_large_matrices"):
        check_memory_options(args)
    check_memory_options(TrainingArguments(model_config=str(path)))  # the same model without it is fine


def test_planner_leaves_out_the_chunked_reversible_backward():
    from peer.memory_plan import candidates

    config = small_config(reversible=True)
    chunked = {(c.reversible_chunk_tokens, c.reversible_chunk_heads) for c in candidates(config, 4, ["fp16"])}
    assert len(chunked) > 1
    kept = candidates(config, 4, ["fp16"], reversible_chunks=False)
    assert kept and {(c.reversible_chunk_tokens, c.reversible_chunk_heads) for c in kept} == {(0, 0)}
