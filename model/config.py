"""LeanTransformerConfig: one typed, validated config for every lean model variant."""

from __future__ import annotations

from transformers import PretrainedConfig

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
ATTENTION_TYPES = ("causal", "bidirectional")
POSITION_EMBEDDING_TYPES = ("rotary", "absolute")
NORM_SCHEMES = ("pre", "sandwich")


class LeanTransformerConfig(PretrainedConfig):
    """Architecture of the lean transformer plus the defaults of its memory options.

    Architecture fields change the function the model computes; memory fields
    (``custom_ffn``, ``custom_attention``, ``checkpoint_layers``, ``loss_chunk_size``) only change
    how it is computed and are proven not to change the math. ``reversible`` is architecture: a
    reversible stack computes a different (RevNet-style) function.
    """

    model_type = "lean_transformer"

    def __init__(
        self,
        vocab_size: int = 4096,
        # model width (d_model)
        hidden_size: int = 256,
        # factorized embedding size (ALBERT); None means hidden_size
        embedding_size: int | None = None,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        # FFN inner size
        intermediate_size: int = 1024,
        # FFN activation, one of ACTIVATIONS
        hidden_act: str = "gelu",
        # gated FFN (GeGLU when hidden_act is gelu): act(x W_gate) * (x W_up)
        gated_ffn: bool = False,
        # "causal" (GPT) or "bidirectional" (ALBERT/MLM)
        attention_type: str = "causal",
        # "rotary" (default) or learned "absolute" positions
        position_embedding_type: str = "rotary",
        rotary_base: float = 10000.0,
        max_position_embeddings: int = 2048,
        # "pre" (pre-norm, default) or "sandwich" (extra layer norm on each sub-layer output)
        norm_scheme: str = "pre",
        # keep the residual stream in fp32 under autocast
        fp32_residual: bool = False,
        layer_norm_eps: float = 1e-5,
        hidden_dropout_prob: float = 0.0,
        attention_probs_dropout_prob: float = 0.0,
        initializer_range: float = 0.02,
        # ALBERT-style sharing: layers are split into this many groups of consecutive layers that
        # share all parameters; None means no sharing (one group per layer)
        num_hidden_groups: int | None = None,
        # share the large FFN/attention matrices across all layers (each layer keeps norms, biases)
        share_large_matrices: bool = False,
        # rank of per-layer low-rank adapters added to shared matrices (0 = none)
        adapter_dim: int = 0,
        # PixelFly block size for FFN and attention projections (0 = dense)
        block_size: int = 0,
        # rank of the low-rank term added to PixelFly matrices (0 = none)
        lowrank_dim: int = 0,
        # reversible residual stack (revlib); architecture, not just a memory option
        reversible: bool = False,
        # memory options (defaults; apply_memory_options can change them on a built model)
        custom_ffn: bool = True,
        custom_attention: bool = True,
        checkpoint_layers: bool = False,
        # tokens per chunk of the chunked LM loss: full (tokens x vocab) logits are never alive;
        # 0 = plain autograd loss over full logits (the reference)
        loss_chunk_size: int = 256,
        # reversible stack only: backward of the FFN a few tokens at a time and of attention a few heads
        # at a time, so its transient buffers shrink with the chunk (0 = whole sequence / all heads)
        reversible_chunk_tokens: int = 0,
        reversible_chunk_heads: int = 0,
        # token-type (segment) embeddings, e.g. 2 for ALBERT sentence pairs; 0 = none
        type_vocab_size: int = 0,
        tie_word_embeddings: bool = True,
        pad_token_id: int | None = 0,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.embedding_size = hidden_size if embedding_size is None else embedding_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.gated_ffn = gated_ffn
        self.attention_type = attention_type
        self.position_embedding_type = position_embedding_type
        self.rotary_base = rotary_base
        self.max_position_embeddings = max_position_embeddings
        self.norm_scheme = norm_scheme
        self.fp32_residual = fp32_residual
        self.layer_norm_eps = layer_norm_eps
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.initializer_range = initializer_range
        self.num_hidden_groups = num_hidden_layers if num_hidden_groups is None else num_hidden_groups
        self.share_large_matrices = share_large_matrices
        self.adapter_dim = adapter_dim
        self.block_size = block_size
        self.lowrank_dim = lowrank_dim
        self.reversible = reversible
        self.custom_ffn = custom_ffn
        self.custom_attention = custom_attention
        self.checkpoint_layers = checkpoint_layers
        self.loss_chunk_size = loss_chunk_size
        self.reversible_chunk_tokens = reversible_chunk_tokens
        self.reversible_chunk_heads = reversible_chunk_heads
        self.type_vocab_size = type_vocab_size
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            **kwargs,
        )
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        """Raise ValueError naming the bad field, its value and what is valid."""
        for name in (
            "vocab_size",
            "hidden_size",
            "embedding_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "num_hidden_groups",
        ):
            _check_int(self, name, minimum=1)
        for name in (
            "loss_chunk_size",
            "reversible_chunk_tokens",
            "reversible_chunk_heads",
            "adapter_dim",
            "block_size",
            "lowrank_dim",
            "type_vocab_size",
        ):
            _check_int(self, name, minimum=0)
        for name in (
            "gated_ffn",
            "fp32_residual",
            "share_large_matrices",
            "reversible",
            "custom_ffn",
            "custom_attention",
            "checkpoint_layers",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("layer_norm_eps", "initializer_range", "rotary_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}); e.g. hidden_size={self.num_attention_heads * 64}"
            )
        if self.position_embedding_type == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"rotary embeddings need an even head dim, got {self.head_dim}; "
                "change hidden_size or num_attention_heads, or use position_embedding_type='absolute'"
            )
        for name, valid in (
            ("hidden_act", ACTIVATIONS),
            ("attention_type", ATTENTION_TYPES),
            ("position_embedding_type", POSITION_EMBEDDING_TYPES),
            ("norm_scheme", NORM_SCHEMES),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(f"unknown {name}={getattr(self, name)!r}; valid values: {', '.join(valid)}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
        if self.num_hidden_layers % self.num_hidden_groups:
            raise ValueError(
                f"num_hidden_layers ({self.num_hidden_layers}) must be a multiple of "
                f"num_hidden_groups ({self.num_hidden_groups}); e.g. num_hidden_groups=1 shares "
                "one set of layer parameters across all layers"
            )
        if self.adapter_dim and not self.share_large_matrices:
            raise ValueError("adapter_dim > 0 needs share_large_matrices=True (adapters are added to shared matrices)")
        if self.lowrank_dim and not self.block_size:
            raise ValueError("lowrank_dim > 0 is the low-rank term of PixelFly layers: set block_size > 0 too")
        if self.block_size:
            self._validate_pixelfly_shapes()
        if self.reversible and self.checkpoint_layers:
            raise ValueError(
                "reversible=True already recomputes activations; it cannot be combined with "
                "checkpoint_layers=True: pick one"
            )

    def projection_shapes(self) -> dict:
        """(in_features, out_features) of every projection in a layer, by name."""
        hidden, inner = self.hidden_size, self.intermediate_size
        return {
            "qkv": (hidden, 3 * hidden),
            "out": (hidden, hidden),
            "up": (hidden, inner * (2 if self.gated_ffn else 1)),
            "down": (inner, hidden),
        }

    def _validate_pixelfly_shapes(self) -> None:
        from model.pixelfly import butterfly_block_layout  # raises ValueError naming valid sizes

        for name, (fan_in, fan_out) in self.projection_shapes().items():
            try:
                butterfly_block_layout(fan_out, fan_in, self.block_size)
            except ValueError as error:
                raise ValueError(
                    f"block_size={self.block_size} does not fit the {name} projection "
                    f"({fan_in} -> {fan_out}) of hidden_size={self.hidden_size}, intermediate_size="
                    f"{self.intermediate_size}: {error}"
                ) from error


def _check_int(config: LeanTransformerConfig, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer (0 disables it)"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
