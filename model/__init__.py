"""The lean transformer: no training, networking, optimizer or CLI code in here."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForPreTraining

from model.config import LeanTransformerConfig
from model.memory import apply_memory_options, block_grad_scales, use_plain_reference
from model.modeling import LeanAlbertForPreTraining, LeanGPTForCausalLM, LeanModel, LeanPreTrainedModel
from model.presets import PRESETS_DIR, available_presets, load_config

AutoConfig.register(LeanTransformerConfig.model_type, LeanTransformerConfig, exist_ok=True)
AutoModel.register(LeanTransformerConfig, LeanModel, exist_ok=True)
AutoModelForCausalLM.register(LeanTransformerConfig, LeanGPTForCausalLM, exist_ok=True)
AutoModelForPreTraining.register(LeanTransformerConfig, LeanAlbertForPreTraining, exist_ok=True)

__all__ = [
    "LeanTransformerConfig",
    "LeanPreTrainedModel",
    "LeanModel",
    "LeanGPTForCausalLM",
    "LeanAlbertForPreTraining",
    "apply_memory_options",
    "block_grad_scales",
    "use_plain_reference",
    "load_config",
    "available_presets",
    "PRESETS_DIR",
]
