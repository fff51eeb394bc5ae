"""Causal-LM and MLM models as Hugging Face PreTrainedModels (plain-autograd first version).

The lean (custom-backward, chunked, checkpointed, reversible) paths replace the internals; the
public API below stays: LeanGPTForCausalLM(config)(input_ids, attention_mask=None, labels=None).loss
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from model.config import LeanTransformerConfig

_ACT = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


def rotary_cos_sin(seq_len: int, dim: int, base: float, device, dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x, cos, sin):
    # x: [batch, heads, seq, head_dim]; rotate pairs (even, odd) halves
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LeanAttention(nn.Module):
    def __init__(self, config: LeanTransformerConfig):
        super().__init__()
        self.config = config
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)
        self.sandwich_norm = (nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                              if config.norm_scheme == "sandwich" else None)

    def forward(self, hidden, key_padding_mask=None, rotary=None):
        cfg = self.config
        b, s, d = hidden.shape
        q, k, v = self.qkv(self.norm(hidden)).view(b, s, 3, cfg.num_attention_heads, cfg.head_dim).permute(2, 0, 3, 1, 4)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        scores = q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim)
        if cfg.attention_type == "causal":
            causal = torch.ones(s, s, dtype=torch.bool, device=hidden.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if key_padding_mask is not None:  # [b, s], True = real token
            scores = scores.masked_fill(~key_padding_mask[:, None, None, :].bool(), float("-inf"))
        probs = F.dropout(scores.softmax(-1), cfg.attention_probs_dropout_prob, self.training)
        attn = (probs @ v).transpose(1, 2).reshape(b, s, d)
        out = F.dropout(self.out(attn), cfg.hidden_dropout_prob, self.training)
        return self.sandwich_norm(out) if self.sandwich_norm is not None else out


class LeanFFN(nn.Module):
    def __init__(self, config: LeanTransformerConfig):
        super().__init__()
        self.config = config
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size * (2 if config.gated_ffn else 1))
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)
        self.sandwich_norm = (nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                              if config.norm_scheme == "sandwich" else None)

    def forward(self, hidden):
        act = _ACT[self.config.hidden_act]
        pre = self.up(self.norm(hidden))
        if self.config.gated_ffn:
            gate, up = pre.chunk(2, dim=-1)
            inner = act(gate) * up
        else:
            inner = act(pre)
        out = F.dropout(self.down(inner), self.config.hidden_dropout_prob, self.training)
        return self.sandwich_norm(out) if self.sandwich_norm is not None else out


class LeanLayer(nn.Module):
    def __init__(self, config: LeanTransformerConfig):
        super().__init__()
        self.attention = LeanAttention(config)
        self.ffn = LeanFFN(config)

    def forward(self, hidden, key_padding_mask=None, rotary=None):
        hidden = hidden + self.attention(hidden, key_padding_mask, rotary)
        return hidden + self.ffn(hidden)


class LeanPreTrainedModel(PreTrainedModel):
    config_class = LeanTransformerConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = False

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
    def __init__(self, config: LeanTransformerConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.embedding_size)
        self.positions = (nn.Embedding(config.max_position_embeddings, config.embedding_size)
                          if config.position_embedding_type == "absolute" else None)
        self.embedding_proj = (nn.Linear(config.embedding_size, config.hidden_size)
                               if config.embedding_size != config.hidden_size else None)
        self.layers = nn.ModuleList([LeanLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def forward(self, input_ids, attention_mask=None):
        b, s = input_ids.shape
        hidden = self.embeddings(input_ids)
        if self.positions is not None:
            hidden = hidden + self.positions(torch.arange(s, device=input_ids.device))
        if self.embedding_proj is not None:
            hidden = self.embedding_proj(hidden)
        rotary = None
        if self.config.position_embedding_type == "rotary":
            rotary = rotary_cos_sin(s, self.config.head_dim, self.config.rotary_base, hidden.device, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask, rotary)
        return self.final_norm(hidden)


class LeanGPTForCausalLM(LeanPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "transformer.embeddings.weight"}

    def __init__(self, config: LeanTransformerConfig):
        super().__init__(config)
        self.transformer = LeanModel(config)
        self.lm_head = nn.Linear(config.embedding_size, config.vocab_size, bias=False)
        self.head_proj = (nn.Linear(config.hidden_size, config.embedding_size)
                          if config.embedding_size != config.hidden_size else None)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.embeddings

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        hidden = self.transformer(input_ids, attention_mask)
        if self.head_proj is not None:
            hidden = self.head_proj(hidden)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
