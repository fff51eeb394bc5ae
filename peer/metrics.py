"""Per-epoch training metrics: the DHT schema, publishing (trainers) and fetching (aux peers).

Records live under ``<run_id>_metrics``; the subkey is the peer's public key, so only the owner can
write its entry (RSASignatureValidator), and the value must match ``LocalMetrics`` (SchemaValidator).
hivemind 1.1.12's SchemaValidator needs pydantic.v1-style models with strict number types.
"""
from __future__ import annotations

import logging
import math
from typing import Dict, Optional

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

METRICS_EXPIRATION = 600.0  # seconds a peer's record stays visible after its last update


class LocalMetrics(pydantic.BaseModel):
    """What one trainer reports about one global epoch it took part in."""

    epoch: pydantic.conint(ge=0, strict=True)  # global epoch these numbers belong to
    samples_per_second: pydantic.confloat(ge=0.0, le=1e9, strict=True)
    samples_accumulated: pydantic.conint(ge=0, strict=True)  # samples this peer contributed in the epoch
    loss: pydantic.confloat(ge=0.0, le=1e6, strict=True)  # sum of micro-step losses in the epoch
    mini_steps: pydantic.conint(ge=0, strict=True)  # number of micro-steps summed into loss
    samples_total: pydantic.conint(ge=0, strict=True) = 0  # all samples this peer contributed so far
    time: pydantic.confloat(ge=0.0, strict=True) = 0.0  # DHT time of the report

    @pydantic.validator("samples_per_second", "loss", "time")
    def _finite(cls, value):
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value

    class Config:
        extra = pydantic.Extra.forbid


class MetricsSchema(pydantic.BaseModel):
    metrics: Dict[BytesWithPublicKey, LocalMetrics]


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def publish_metrics(dht: hivemind.DHT, run_id: str, public_key: bytes, metrics: LocalMetrics,
                    expiration: float = METRICS_EXPIRATION):
    """Store this peer's metrics without blocking the training loop; returns a future."""
    return dht.store(key=metrics_key(run_id), subkey=public_key, value=metrics.dict(),
                     expiration_time=get_dht_time() + expiration, return_future=True)


def fetch_metrics(dht: hivemind.DHT, run_id: str, timeout: Optional[float] = None) -> Dict[bytes, LocalMetrics]:
    """All peers' latest metrics; entries that do not parse are skipped with a log line."""
    result = dht.get(metrics_key(run_id), latest=True, return_future=timeout is not None)
    if timeout is not None:
        result = result.result(timeout=timeout)
    if result is None or not isinstance(result.value, dict):
        return {}
    metrics = {}
    for subkey, entry in result.value.items():
        try:
            metrics[subkey] = LocalMetrics.parse_obj(entry.value)
        except (pydantic.ValidationError, TypeError) as e:
            logger.warning("Ignoring a malformed metrics record: %s", e)
    return metrics
