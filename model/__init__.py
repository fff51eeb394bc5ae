"""The lean transformer: no training, networking, optimizer or CLI code in here."""
from model.config import LeanTransformerConfig
from model.modeling import LeanGPTForCausalLM, LeanModel

__all__ = ["LeanTransformerConfig", "LeanGPTForCausalLM", "LeanModel"]
