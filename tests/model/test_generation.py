"""Generation with a KV cache: incremental logits equal the full forward pass (float64), for every architecture
(rotary and absolute positions, sharing, PixelFly, the reversible stack) and memory option, with and without
left padding; greedy output is the same with and without the cache; sampling, beam search and the
text-generation pipeline run with the shipped tokenizer."""

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache, pipeline

from model import LeanAlbertForPreTraining, LeanGPTForCausalLM, apply_memory_options
from model.modeling import output_cache
from peer.swarm.data import shipped_tokenizer_dir
from tests.support.model import VOCAB, randomize, small_config

pytestmark = pytest.mark.deps  # scripts/test.sh --newest/--oldest run these

TOLERANCE = 1e-10  # float64: the cached path reorders a few sums, nothing more

ARCHITECTURES = {
    "rotary": {},
    "absolute": dict(position_embedding_type="absolute"),
    "sandwich_geglu": dict(norm_scheme="sandwich", gated_ffn=True, fp32_residual=True),
    "groups": dict(num_hidden_layers=4, num_hidden_groups=2),
    "shared_adapters": dict(share_large_matrices=True, adapter_dim=4),
    "pixelfly_lowrank": dict(block_size=8, lowrank_dim=4),
    "factorized_embedding": dict(embedding_size=16),
    "reversible": dict(reversible=True),
    "reversible_shared_pixelfly": dict(reversible=True, block_size=8, share_large_matrices=True, adapter_dim=4),
}
MEMORY = {
    "custom": dict(custom_ffn=True, custom_attention=True),
    "plain": dict(custom_ffn=False, custom_attention=False),
    "checkpoint_chunked_loss": dict(checkpoint_layers=True, loss_chunk_size=5),
}


def _model(architecture: str, memory: str = "custom") -> LeanGPTForCausalLM:
    options = MEMORY[memory]
    if ARCHITECTURES[architecture].get("reversible"):
        options = {k: v for k, v in options.items() if k != "checkpoint_layers"}
    model = randomize(LeanGPTForCausalLM(small_config(**ARCHITECTURES[architecture])).double())
    return apply_memory_options(model, **options).eval()


def _batch(padded: bool, length: int = 12):
    input_ids = torch.randint(4, VOCAB, (3, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(input_ids)
    if padded:  # left padding, as generate() batches prompts; row 2 is padded all the way into the cached part
        mask[1, :3] = 0
        mask[2, :7] = 0
    return input_ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)  # what generate() passes: padding does not shift positions


def _incremental_logits(model, input_ids, mask, splits):
    """Logits computed in pieces through one DynamicCache (prefill, then a few tokens, then one at a time)."""
    cache, pieces, start = DynamicCache(config=model.config), [], 0
    positions = _positions(mask)
    for end in [*splits, input_ids.shape[1]]:
        out = model(
            input_ids[:, start:end],
            attention_mask=mask[:, :end],
            position_ids=positions[:, start:end],
            past_key_values=cache,
            use_cache=True,
        )
        assert output_cache(out) is cache and cache.get_seq_length() == end
        pieces.append(out.logits)
        start = end
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("architecture,memory", [(a, "custom") for a in ARCHITECTURES] + [("rotary", "plain")])
@torch.no_grad()
def test_cached_logits_equal_full_forward(architecture, memory, padded):
    model = _model(architecture, memory)
    input_ids, mask = _batch(padded)
    full = model(input_ids, attention_mask=mask, position_ids=_positions(mask)).logits
    incremental = _incremental_logits(model, input_ids, mask, splits=[5, 8, 9, 10, 11])
    real = mask.bool()  # padded queries see no key: their outputs carry no meaning either way
    assert (incremental - full)[real].abs().max().item() < TOLERANCE


@torch.no_grad()
def test_default_positions_continue_after_the_cache():
    model = _model("rotary")
    input_ids, _ = _batch(padded=False)
    full = model(input_ids).logits  # no position_ids: 0..seq-1, the training path
    cache = DynamicCache(config=model.config)
    first = model(input_ids[:, :7], past_key_values=cache, use_cache=True).logits
    rest = model(input_ids[:, 7:], past_key_values=cache).logits  # positions 7.. from the cache length
    assert (torch.cat([first, rest], 1) - full).abs().max().item() < TOLERANCE


@torch.no_grad()
def test_left_padding_does_not_change_a_prompts_continuation():
    model = _model("rotary")
    prompt = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    alone = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), prompt], 1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(prompt)], 1)
    batched = model.generate(padded, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(batched[:, 4:], alone)


@pytest.mark.parametrize("architecture", ["rotary", "absolute", "reversible"])
@torch.no_grad()
def test_greedy_output_is_identical_with_and_without_cache(architecture):
    model = _model(architecture, "checkpoint_chunked_loss")  # training-time options on: generation ignores them
    input_ids, mask = _batch(padded=True, length=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    cached = model.generate(input_ids, use_cache=True, **kwargs)
    uncached = model.generate(input_ids, use_cache=False, **kwargs)
    assert cached.shape == (3, 16)
    assert torch.equal(cached, uncached)


@torch.no_grad()
def test_sampling_and_beam_search_run_and_sampling_follows_the_seed():
    model = _model("rotary")
    input_ids, _ = _batch(padded=False, length=5)
    sample = dict(do_sample=True, top_k=20, temperature=0.9, max_new_tokens=8, pad_token_id=0)
    torch.manual_seed(0)
    first = model.generate(input_ids, **sample)
    torch.manual_seed(0)
    assert torch.equal(first, model.generate(input_ids, **sample))
    beams = model.generate(input_ids, num_beams=3, num_return_sequences=2, max_new_tokens=6, pad_token_id=0)
    assert beams.shape == (6, 11) and torch.equal(beams[::2, :5], input_ids)
    uncached = model.generate(
        input_ids, num_beams=3, num_return_sequences=2, max_new_tokens=6, pad_token_id=0, use_cache=False
    )
    assert torch.equal(beams, uncached)


def test_training_paths_are_untouched_by_the_cache_arguments():
    """A training step (labels, grad on) returns no cache and the same loss as before; the cache refuses grad mode."""
    model = _model("rotary").train()
    input_ids, mask = _batch(padded=True)
    out = model(input_ids, attention_mask=mask, labels=input_ids)
    assert output_cache(out) is None and out.logits is None
    out.loss.backward()
    with pytest.raises(ValueError, match="inference only"):
        model(input_ids, use_cache=True)
    with torch.no_grad(), pytest.raises(ValueError, match="must cover the cached and the new tokens"):
        cache = DynamicCache(config=model.config)
        model(input_ids[:, :4], past_key_values=cache)
        model(input_ids[:, 4:], attention_mask=mask[:, 4:], past_key_values=cache)


def test_dropout_models_must_be_in_eval_mode_to_cache():
    model = LeanGPTForCausalLM(small_config(hidden_dropout_prob=0.1)).train()
    with torch.no_grad(), pytest.raises(ValueError, match="model.eval"):
        model(torch.ones(1, 3, dtype=torch.long), use_cache=True)


def test_bidirectional_model_refuses_a_cache():
    model = LeanAlbertForPreTraining(small_config(attention_type="bidirectional", type_vocab_size=2)).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="causal"):
        model.transformer(torch.ones(1, 3, dtype=torch.long), past_key_values=DynamicCache())


def test_text_generation_pipeline_with_the_shipped_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(shipped_tokenizer_dir())
    config = small_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model = LeanGPTForCausalLM(config).eval()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    [result] = generator("The swarm", max_new_tokens=5, do_sample=False)
    assert result["generated_text"].startswith("The swarm")
    assert len(tokenizer(result["generated_text"])["input_ids"]) > len(tokenizer("The swarm")["input_ids"])
