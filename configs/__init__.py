"""LeanHive's shipped presets, installed as package data so they are found from a wheel as well as a checkout.

``MODEL_PRESETS_DIR`` holds the model presets (``<name>.json``, read by ``model.load_config``);
``RUN_PRESETS_DIR`` holds the run presets (``<name>.yaml``, read by the peers' ``--config``).
"""

from pathlib import Path

MODEL_PRESETS_DIR = Path(__file__).resolve().parent / "model"
RUN_PRESETS_DIR = Path(__file__).resolve().parent / "run"

__all__ = ["MODEL_PRESETS_DIR", "RUN_PRESETS_DIR"]
