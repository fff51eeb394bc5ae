"""The lean transformer body (``LeanModel``) and its heads as Hugging Face ``PreTrainedModel``s.

* ``LeanGPTForCausalLM``: causal LM; ``model(input_ids=..., labels=...).loss``; ``generate()`` with a KV cache
  (transformers' ``DynamicCache``, see ``model.inference``).

The cache argument has two names across the transformers versions LeanHive supports: ``past_key_values`` up to
5.23, ``cache`` from 5.24 on (``generate()`` passes it under that name and reads it back from the output's ``cache``
field). The forward passes accept both names and return the cache in the field the installed output classes have
(``CACHE_FIELD``), so ``generate()`` of either generation finds it.
* ``LeanAlbertForPreTraining``: bidirectional masked LM + sentence-order prediction.

Both round-trip through ``save_pretrained``/``from_pretrained`` and are registered with the Auto
classes (see ``model/__init__.py``). Memory options live in ``model.memory.apply_memory_options``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import ModelOutput

from model.config import LeanTransformerConfig
from model.inference import stack_forward_cached
from model.ops.activations import activate
from model.ops.dropout import draw_seed, seeded_dropout
from model.ops.loss import IGNORE_INDEX, lm_loss
from model.ops.norm import layer_norm
from model.ops.projection import ComputeContext
from model.ops.rotary import rotary_tables, rotary_tables_at
from model.stack import LayerStack

# The output field generate() reads the cache back from: "cache" from transformers 5.24 on, "past_key_values" before.
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def output_cache(output: ModelOutput) -> Optional[Cache]:
    """The cache a forward pass returned, whatever the installed transformers calls the field."""
    return getattr(output, CACHE_FIELD)


def _one_cache(cache: Optional[Cache], past_key_values: Optional[Cache]) -> Optional[Cache]:
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the KV cache once, as cache= (transformers >= 5.24) or past_key_values=, not both")
    return cache if cache is not None else past_key_values


@contextlib.contextmanager
def _default_device_and_dtype(device, dtype):
    """Create parameters directly on ``device`` in ``dtype`` (no full fp32 CPU copy first)."""
    previous_dtype = torch.get_default_dtype()
    if dtype is not None:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype such as torch.bfloat16, got {dtype}")
        torch.set_default_dtype(dtype)
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(previous_dtype)


class LeanPreTrainedModel(PreTrainedModel):
    config_class = LeanTransformerConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = False  # use model.memory.apply_memory_options(checkpoint_layers=True)

    @classmethod
    def build(cls, config: LeanTransformerConfig, *, device=None, dtype: Optional[torch.dtype] = None):
        """Build the model with parameters allocated directly on ``device`` (e.g. "cuda", "meta") in ``dtype``."""
        with _default_device_and_dtype(device, dtype):
            model = cls(config)
        if dtype is not None:
            model.config.dtype = dtype
        return model

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


class LeanModel(LeanPreTrainedModel):
    """Embeddings -> layer stack -> final layer norm."""

    def __init__(self, config: LeanTransformerConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.embedding_size)
        self.positions = (
            nn.Embedding(config.max_position_embeddings, config.embedding_size)
            if config.position_embedding_type == "absolute"
            else None
        )
        self.token_types = (
            nn.Embedding(config.type_vocab_size, config.embedding_size) if config.type_vocab_size else None
        )
        self.embedding_proj = (
            nn.Linear(config.embedding_size, config.hidden_size)
            if config.embedding_size != config.hidden_size
            else None
        )
        self.stack = LayerStack(config)
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def _embed(self, input_ids, token_type_ids, position_ids):
        seq_len = input_ids.shape[1]
        hidden = self.embeddings(input_ids)
        if self.positions is not None:
            last = seq_len if position_ids is None else int(position_ids.max()) + 1
            if last > self.config.max_position_embeddings:
                raise ValueError(
                    f"sequence length {last} exceeds max_position_embeddings "
                    f"({self.config.max_position_embeddings}); use shorter sequences or rotary positions"
                )
            positions = torch.arange(seq_len, device=input_ids.device) if position_ids is None else position_ids
            hidden = hidden + self.positions(positions)
        if self.token_types is not None:
            hidden = hidden + self.token_types(
                token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            )
        if self.embedding_proj is not None:
            hidden = self.embedding_proj(hidden)
        p = self.config.hidden_dropout_prob
        return seeded_dropout(hidden, p, draw_seed(p, self.training))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        past_key_values: Optional[Cache] = None,
        use_cache: Optional[bool] = None,
        cache: Optional[Cache] = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """attention_mask: [batch, seq], 1 for real tokens and 0 for padding (HF convention); with a cache it
        covers the cached tokens too ([batch, past + seq]).

        position_ids: [batch, seq] positions of the tokens (default 0..seq-1, or past..past+seq-1 after a cache).
        past_key_values (or cache) / use_cache: inference with a KV cache (``generate()`` passes them): only the new
        tokens are computed, attending to the cached keys and values; the cache is returned, extended.
        """
        past_key_values = _one_cache(cache, past_key_values)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if past_key_values is not None:
            self._check_cache_allowed(past_key_values)
            if position_ids is None:
                past = past_key_values.get_seq_length()
                position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
                position_ids = position_ids.expand(input_ids.shape[0], -1)
        hidden = self._embed(input_ids, token_type_ids, position_ids)
        if self.config.fp32_residual:  # residual stream in (at least) fp32 whatever the compute dtype
            hidden = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
        compute = ComputeContext.current(hidden.device, self.final_norm.weight.dtype)
        rotary = None
        if self.config.position_embedding_type == "rotary" and position_ids is None:
            rotary = rotary_tables(
                input_ids.shape[1], self.config.head_dim, self.config.rotary_base, hidden.device, compute.dtype
            )
        elif self.config.position_embedding_type == "rotary":
            rotary = rotary_tables_at(position_ids, self.config.head_dim, self.config.rotary_base, compute.dtype)
        key_padding_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            key_padding_mask = attention_mask.bool()
        if past_key_values is None:
            hidden = self.stack(hidden, rotary, key_padding_mask)
        else:
            expected = past_key_values.get_seq_length() + input_ids.shape[1]
            if attention_mask is not None and attention_mask.shape[-1] != expected:
                raise ValueError(
                    f"with a KV cache, attention_mask must cover the cached and the new tokens: expected "
                    f"[batch, {expected}], got {list(attention_mask.shape)}"
                )
            hidden = stack_forward_cached(self.stack, hidden, rotary, key_padding_mask, past_key_values)
        hidden = layer_norm(hidden, self.final_norm.weight, self.final_norm.bias, self.config.layer_norm_eps)
        return BaseModelOutputWithPast(last_hidden_state=hidden, **{CACHE_FIELD: past_key_values})

    def _check_cache_allowed(self, cache) -> None:
        if not isinstance(cache, Cache):
            raise ValueError(
                f"past_key_values must be a transformers Cache (e.g. DynamicCache()), got {type(cache).__name__}"
            )
        if self.config.attention_type != "causal":
            raise ValueError("a KV cache needs causal attention; this model is bidirectional (attention_type)")
        if torch.is_grad_enabled():
            raise ValueError(
                "the KV cache is for inference only: run under torch.no_grad() (generate() does), "
                "or pass use_cache=False to train"
            )
        dropout = max(self.config.hidden_dropout_prob, self.config.attention_probs_dropout_prob)
        if self.training and dropout > 0:
            raise ValueError(f"the KV cache runs without dropout (p={dropout}): call model.eval() before generating")


class LeanGPTForCausalLM(LeanPreTrainedModel, GenerationMixin):
    """Causal LM; with labels, the loss is chunked and logits are returned only if asked for.

    ``generate()`` (greedy, sampling, beam search) uses a KV cache unless ``use_cache=False``.
    """

    _tied_weights_keys = {"lm_head.weight": "transformer.embeddings.weight"}

    def __init__(self, config: LeanTransformerConfig):
        if config.attention_type != "causal":
            raise ValueError(
                f"LeanGPTForCausalLM needs attention_type='causal', got {config.attention_type!r}; "
                "use LeanAlbertForPreTraining for bidirectional attention"
            )
        super().__init__(config)
        self.transformer = LeanModel(config)
        self.head_proj = (
            nn.Linear(config.hidden_size, config.embedding_size)
            if config.embedding_size != config.hidden_size
            else None
        )
        self.lm_head = nn.Linear(config.embedding_size, config.vocab_size, bias=False)
        self.loss_chunk_size = config.loss_chunk_size
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.embeddings

    def get_output_embeddings(self):
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        return_logits: bool = False,
        position_ids: Optional[torch.Tensor] = None,
        past_key_values: Optional[Cache] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: int = 0,
        cache: Optional[Cache] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """labels: [batch, seq] token ids (usually input_ids); position t predicts labels[:, t + 1].

        Labels equal to -100, and labels at padded positions (attention_mask == 0), are ignored.
        Logits are returned when no labels are given or when return_logits=True; logits_to_keep > 0 computes
        them for the last that many positions only (generate() asks for 1).
        position_ids, past_key_values (or cache), use_cache: see LeanModel.forward (inference with a KV cache).
        """
        outputs = self.transformer(
            input_ids,
            attention_mask,
            position_ids=position_ids,
            past_key_values=_one_cache(cache, past_key_values),
            use_cache=use_cache,
        )
        hidden = outputs.last_hidden_state
        if self.head_proj is not None:
            hidden = self.head_proj(hidden.to(self.head_proj.weight.dtype))
        loss = logits = None
        if labels is not None:
            if attention_mask is not None:
                labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # shift targets, not hidden (no copy)
            loss = lm_loss(hidden.flatten(0, 1), self.lm_head.weight, None, targets.flatten(), self.loss_chunk_size)
        if labels is None or return_logits:
            if logits_to_keep > 0:
                hidden = hidden[:, -logits_to_keep:]
            logits = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: output_cache(outputs)})


@dataclass
class LeanAlbertForPreTrainingOutput(ModelOutput):
    loss: Optional[torch.Tensor] = None
    mlm_loss: Optional[torch.Tensor] = None
    sop_loss: Optional[torch.Tensor] = None
    prediction_logits: Optional[torch.Tensor] = None
    sop_logits: Optional[torch.Tensor] = None


class LeanAlbertForPreTraining(LeanPreTrainedModel):
    """Masked LM (tied decoder) + sentence-order prediction on the first token."""

    _tied_weights_keys = {"mlm_decoder.weight": "transformer.embeddings.weight"}

    def __init__(self, config: LeanTransformerConfig):
        if config.attention_type != "bidirectional":
            raise ValueError(
                f"LeanAlbertForPreTraining needs attention_type='bidirectional', got "
                f"{config.attention_type!r}; use LeanGPTForCausalLM for causal attention"
            )
        super().__init__(config)
        self.transformer = LeanModel(config)
        self.mlm_dense = nn.Linear(config.hidden_size, config.embedding_size)
        self.mlm_norm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.mlm_decoder = nn.Linear(config.embedding_size, config.vocab_size)
        self.sop_pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.sop_classifier = nn.Linear(config.hidden_size, 2)
        self.loss_chunk_size = config.loss_chunk_size
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.embeddings

    def get_output_embeddings(self):
        return self.mlm_decoder

    def _mlm_transform(self, hidden):
        hidden = activate(self.mlm_dense(hidden.to(self.mlm_dense.weight.dtype)), self.config.hidden_act, False)
        return self.mlm_norm(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        sentence_order_label: Optional[torch.Tensor] = None,
        return_logits: bool = False,
        **kwargs,
    ) -> LeanAlbertForPreTrainingOutput:
        """labels: [batch, seq] original ids at masked positions, -100 elsewhere; sentence_order_label:
        [batch], 0 = segments in order, 1 = swapped. The MLM head runs only on labelled positions."""
        hidden = self.transformer(input_ids, attention_mask, token_type_ids).last_hidden_state
        mlm_loss = sop_loss = prediction_logits = None
        if labels is not None:
            flat_labels = labels.flatten()
            selected = (flat_labels != IGNORE_INDEX).nonzero()[:, 0]
            mlm_hidden = self._mlm_transform(hidden.flatten(0, 1).index_select(0, selected))
            mlm_loss = lm_loss(
                mlm_hidden,
                self.mlm_decoder.weight,
                self.mlm_decoder.bias,
                flat_labels.index_select(0, selected),
                self.loss_chunk_size,
            )
        if labels is None or return_logits:
            prediction_logits = self.mlm_decoder(self._mlm_transform(hidden))
        pooled = torch.tanh(self.sop_pooler(hidden[:, 0].to(self.sop_pooler.weight.dtype)))
        sop_logits = self.sop_classifier(pooled)
        if sentence_order_label is not None:
            sop_loss = F.cross_entropy(
                sop_logits.to(torch.promote_types(sop_logits.dtype, torch.float32)), sentence_order_label.flatten()
            )
        losses = [value for value in (mlm_loss, sop_loss) if value is not None]
        return LeanAlbertForPreTrainingOutput(
            loss=sum(losses) if losses else None,
            mlm_loss=mlm_loss,
            sop_loss=sop_loss,
            prediction_logits=prediction_logits,
            sop_logits=sop_logits,
        )
