"""Named model presets (``configs/model/<name>.json``) and loading configs from JSON files."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import List, Union

from transformers import PretrainedConfig

from configs import MODEL_PRESETS_DIR
from model.config import LeanTransformerConfig

PRESETS_DIR = MODEL_PRESETS_DIR


def available_presets() -> List[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.json"))


def _known_fields() -> set:
    own = set(inspect.signature(LeanTransformerConfig.__init__).parameters) - {"self", "kwargs"}
    return own | set(PretrainedConfig().to_dict())  # also accept a saved config.json


def load_config(name_or_path: Union[str, Path]) -> LeanTransformerConfig:
    """A preset name (e.g. "tiny") or a path to a JSON file -> validated LeanTransformerConfig.

    Unknown fields are rejected, so a typo cannot silently fall back to a default.
    """
    path = Path(name_or_path)
    if not (path.suffix == ".json" or path.exists()):
        path = PRESETS_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise ValueError(
                f"unknown model preset {str(name_or_path)!r}; available presets: "
                f"{', '.join(available_presets())} (or pass a path to a JSON config file)"
            )
    if not path.is_file():
        raise ValueError(
            f"model config file {str(path)!r} does not exist; pass an existing JSON file or one of "
            f"the presets: {', '.join(available_presets())}"
        )
    try:
        fields = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"model config {str(path)!r} is not valid JSON: {error}") from error
    if not isinstance(fields, dict):
        raise ValueError(f"model config {str(path)!r} must hold a JSON object of config fields")
    unknown = sorted(set(fields) - _known_fields())
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(unknown)} in {str(path)!r}; valid fields are the arguments "
            f"of LeanTransformerConfig, see model/config.py"
        )
    fields.pop("model_type", None)
    return LeanTransformerConfig(**fields)
