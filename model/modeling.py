"""The lean transformer body (``LeanModel``) and its heads as Hugging Face ``PreTrainedModel``s.

* ``LeanGPTForCausalLM``: causal LM; ``model(input_ids=..., labels=...).loss``.
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
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput
from transformers.utils import ModelOutput

from model.config import LeanTransformerConfig
from model.ops.activations import activate
from model.ops.dropout import draw_seed, seeded_dropout
from model.ops.loss import IGNORE_INDEX, lm_loss
from model.ops.norm import layer_norm
from model.ops.projection import ComputeContext
from model.ops.rotary import rotary_tables
from model.stack import LayerStack


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

    def _embed(self, input_ids, token_type_ids):
        seq_len = input_ids.shape[1]
        hidden = self.embeddings(input_ids)
        if self.positions is not None:
            if seq_len > self.config.max_position_embeddings:
                raise ValueError(
                    f"sequence length {seq_len} exceeds max_position_embeddings "
                    f"({self.config.max_position_embeddings}); use shorter sequences or rotary positions"
                )
            hidden = hidden + self.positions(torch.arange(seq_len, device=input_ids.device))
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
        **kwargs,
    ) -> BaseModelOutput:
        """attention_mask: [batch, seq], 1 for real tokens and 0 for padding (HF convention)."""
        hidden = self._embed(input_ids, token_type_ids)
        if self.config.fp32_residual:  # residual stream in (at least) fp32 whatever the compute dtype
            hidden = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
        compute = ComputeContext.current(hidden.device, self.final_norm.weight.dtype)
        rotary = None
        if self.config.position_embedding_type == "rotary":
            rotary = rotary_tables(
                input_ids.shape[1], self.config.head_dim, self.config.rotary_base, hidden.device, compute.dtype
            )
        key_padding_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            key_padding_mask = attention_mask.bool()
        hidden = self.stack(hidden, rotary, key_padding_mask)
        hidden = layer_norm(hidden, self.final_norm.weight, self.final_norm.bias, self.config.layer_norm_eps)
        return BaseModelOutput(last_hidden_state=hidden)


class LeanGPTForCausalLM(LeanPreTrainedModel):
    """Causal LM; with labels, the loss is chunked and logits are returned only if asked for."""

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
        **kwargs,
    ) -> CausalLMOutput:
        """labels: [batch, seq] token ids (usually input_ids); position t predicts labels[:, t + 1].

        Labels equal to -100, and labels at padded positions (attention_mask == 0), are ignored.
        Logits are returned when no labels are given or when return_logits=True.
        """
        hidden = self.transformer(input_ids, attention_mask).last_hidden_state
        if self.head_proj is not None:
            hidden = self.head_proj(hidden.to(self.head_proj.weight.dtype))
        loss = logits = None
        if labels is not None:
            if attention_mask is not None:
                labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # shift targets, not hidden (no copy)
            loss = lm_loss(hidden.flatten(0, 1), self.lm_head.weight, None, targets.flatten(), self.loss_chunk_size)
        if labels is None or return_logits:
            logits = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        return CausalLMOutput(loss=loss, logits=logits)


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
