"""The swarm's DHT records: every key the swarm uses, the validators every peer installs, the metrics schema,
and one reader for the records hivemind writes (training progress, state-sharing declarations).

The keys themselves are derived in ``peer.swarm.keys``. Metrics records have the peer's public key as subkey, so
only the owner can write its entry (RSASignatureValidator), and the value must match ``LocalMetrics``
(SchemaValidator). Progress and state-sharing records are written by hivemind and read here.

hivemind 1.1.12's SchemaValidator needs pydantic.v1-style models with strict number types.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from peer.swarm.hivemind_seam import MAX_CLOCK_SKEW, KeyRule, RecordSizeValidator, SwarmKeyValidator
from peer.swarm.keys import (
    averager_prefixes,
    fingerprints_key,
    matchmaking_keys,
    metrics_key,
    progress_key,
    reachable_key,
    state_sharing_key,
)

__all__ = [
    "FINGERPRINT_SIZE",
    "LocalMetrics",
    "RoundHealth",
    "RoundFingerprint",
    "RoundFingerprints",
    "fetch_fingerprints",
    "publish_fingerprints",
    "MetricsSchema",
    "PeerProgress",
    "fetch_metrics",
    "make_validators",
    "metrics_key",
    "progress_key",
    "publish_metrics",
    "read_progress",
    "read_state_sharing",
    "state_sharing_key",
    "swarm_key_rules",
    "REACHABLE_EXPIRATION",
    "REACHABLE_ROLES",
    "ReachablePeer",
    "fetch_reachable",
    "publish_reachable",
]

logger = logging.getLogger(__name__)

METRICS_EXPIRATION = 600.0  # seconds a peer's record stays visible after its last update
# how far ahead a record may expire under each key, generously above what honest peers write: hivemind's progress
# records live 60 s, state-sharing declarations 30 s, matchmaking declarations until the averaging deadline
PROGRESS_MAX_TTL = 300.0
DECLARATION_MAX_TTL = 600.0
FINGERPRINT_SIZE = 128  # float32 values sampled from the shared parameters (peer.swarm.agreement)
FINGERPRINT_HISTORY = 3  # rounds one record covers: a peer may read a round's records after the next round ended
FINGERPRINT_EXPIRATION = 120.0


# Bounds of the round-health counters: far above what an honest peer reaches in years (a round a second for 30
# years, 10 Gbit/s for a year), so that no claim overflows a sum or a float on the aux peer's side
MAX_ROUNDS = 10**9
MAX_SECONDS = 1e9
MAX_BYTES = 4 * 10**16
MAX_GROUP_SIZE = 4096
SYNC_MODES = ("sync", "local")
REACHABILITY = ("public", "client")


class RoundHealth(pydantic.BaseModel):
    """A trainer's averaging health: totals since it started (``peer.swarm.round_health``), so that a record the
    aux peer misses loses nothing; the aux peer takes differences between the records it reads."""

    rounds_joined: pydantic.conint(ge=0, le=MAX_ROUNDS, strict=True)  # averaging rounds it tried to take part in
    rounds_ok: pydantic.conint(ge=0, le=MAX_ROUNDS, strict=True)
    failed_no_group: pydantic.conint(ge=0, le=MAX_ROUNDS, strict=True)  # matchmaking found nobody in time
    failed_timeout: pydantic.conint(ge=0, le=MAX_ROUNDS, strict=True)  # the all-reduce did not finish in time
    failed_partial: pydantic.conint(ge=0, le=MAX_ROUNDS, strict=True)  # broke off after the group formed
    last_group_size: pydantic.conint(ge=0, le=MAX_GROUP_SIZE, strict=True)  # peers in its last group (0: none)
    compute_seconds: pydantic.confloat(ge=0.0, le=MAX_SECONDS, strict=True)  # forward and backward passes
    wait_seconds: pydantic.confloat(ge=0.0, le=MAX_SECONDS, strict=True)  # training blocked on the swarm
    matchmaking_seconds: pydantic.confloat(ge=0.0, le=MAX_SECONDS, strict=True)
    allreduce_seconds: pydantic.confloat(ge=0.0, le=MAX_SECONDS, strict=True)
    optimizer_seconds: pydantic.confloat(ge=0.0, le=MAX_SECONDS, strict=True)  # the optimizer's update itself
    bytes_sent: pydantic.conint(ge=0, le=MAX_BYTES, strict=True)  # averaging parts and state served
    bytes_received: pydantic.conint(ge=0, le=MAX_BYTES, strict=True)  # averaging parts and state downloaded
    reachability: pydantic.constr(regex=r"^(public|client)$", strict=True)
    sync_mode: pydantic.constr(regex=r"^(sync|local)$", strict=True)
    version: pydantic.constr(regex=r"^[0-9A-Za-z.+-]{1,32}$", strict=True)  # the LeanHive version it runs

    @pydantic.validator(
        "compute_seconds", "wait_seconds", "matchmaking_seconds", "allreduce_seconds", "optimizer_seconds"
    )
    def _finite(cls, value):
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value

    @pydantic.root_validator(skip_on_failure=True)
    def _outcomes_within_rounds(cls, values):
        outcomes = sum(values[name] for name in ("rounds_ok", "failed_no_group", "failed_timeout", "failed_partial"))
        if outcomes > values["rounds_joined"]:
            raise ValueError(f"{outcomes} round outcomes for {values['rounds_joined']} rounds joined")
        return values

    class Config:
        extra = pydantic.Extra.forbid


class LocalMetrics(pydantic.BaseModel):
    """What one trainer reports about one global epoch it took part in."""

    epoch: pydantic.conint(ge=0, strict=True)  # global epoch these numbers belong to
    samples_per_second: pydantic.confloat(ge=0.0, le=1e9, strict=True)
    samples_accumulated: pydantic.conint(ge=0, strict=True)  # samples this peer contributed in the epoch
    loss: pydantic.confloat(ge=0.0, le=1e6, strict=True)  # mean micro-step loss in the epoch
    mini_steps: pydantic.conint(ge=0, strict=True)  # number of micro-steps averaged into loss
    samples_total: pydantic.conint(ge=0, strict=True) = 0  # all samples this peer contributed so far
    time: pydantic.confloat(ge=0.0, strict=True) = 0.0  # DHT time of the report
    health: Optional[RoundHealth] = None  # absent in records of LeanHive versions before it

    @pydantic.validator("samples_per_second", "loss", "time")
    def _finite(cls, value):
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value

    class Config:
        extra = pydantic.Extra.forbid


class MetricsSchema(pydantic.BaseModel):
    metrics: Dict[BytesWithPublicKey, LocalMetrics]


class RoundFingerprint(pydantic.BaseModel):
    """--sync_mode local: a sample of a trainer's shared parameters right after one round (peer.swarm.agreement)."""

    epoch: pydantic.conint(ge=0, strict=True)  # the global epoch the round ended at
    ended: pydantic.confloat(ge=0.0, le=1e12, strict=True)  # DHT time the round ended at
    sample: pydantic.conbytes(min_length=4 * FINGERPRINT_SIZE, max_length=4 * FINGERPRINT_SIZE, strict=True)

    class Config:
        extra = pydantic.Extra.forbid


class RoundFingerprints(pydantic.BaseModel):
    """One trainer's fingerprints of its last few rounds, and the peer ID its state can be downloaded from."""

    peer_id: pydantic.conbytes(min_length=3, max_length=130, strict=True)
    rounds: pydantic.conlist(RoundFingerprint, min_items=1, max_items=FINGERPRINT_HISTORY)

    class Config:
        extra = pydantic.Extra.forbid


class FingerprintsSchema(pydantic.BaseModel):
    round_fingerprints: Dict[BytesWithPublicKey, RoundFingerprints]


REACHABLE_ROLES = ("trainer", "aux", "assist")  # assist: an aux peer that joins the averaging of client trainers
REACHABLE_EXPIRATION = 90.0  # seconds a reachable peer's record lives; it re-announces every third of that


class ReachablePeer(pydantic.BaseModel):
    """A peer that others can dial (it passed a dial-back probe, was the first peer, or was told it is public):
    it serves dial-back probes, and a trainer or an assisting aux can be the reducer of client-mode trainers."""

    peer_id: pydantic.conbytes(min_length=3, max_length=130, strict=True)
    role: pydantic.constr(regex=r"^(trainer|aux|assist)$", strict=True)
    time: pydantic.confloat(ge=0.0, le=1e12, strict=True)  # DHT time of the announcement

    class Config:
        extra = pydantic.Extra.forbid


class ReachableSchema(pydantic.BaseModel):
    reachable: Dict[BytesWithPublicKey, ReachablePeer]


def swarm_key_rules(run_id: str) -> Dict[str, KeyRule]:
    """Every key the swarm reads, with the form its entries must have and how far ahead they may expire."""
    rules = {
        metrics_key(run_id): KeyRule(metrics_key(run_id), "signed", METRICS_EXPIRATION),
        progress_key(run_id): KeyRule(progress_key(run_id), "signed", PROGRESS_MAX_TTL),
        fingerprints_key(run_id): KeyRule(fingerprints_key(run_id), "signed", FINGERPRINT_EXPIRATION),
        reachable_key(run_id): KeyRule(reachable_key(run_id), "signed", REACHABLE_EXPIRATION),
    }
    for prefix in averager_prefixes(run_id):
        sharing = f"{prefix}.all_averagers"
        rules[sharing] = KeyRule(sharing, "peer_priority", DECLARATION_MAX_TTL)
        for key in matchmaking_keys(prefix):
            rules[key] = KeyRule(key, "peer_flag", DECLARATION_MAX_TTL)
    return rules


def make_validators(
    run_id: str, private_key: RSAPrivateKey, extra: Sequence[RecordValidatorBase] = ()
) -> tuple[list, bytes]:
    """Validators every peer of the run installs: record size limit, the form and lifetime of every key the swarm
    reads (no squatting), signature check, schema of the metrics key.

    Returns (validators, local_public_key); the public key is the subkey this peer signs records with.
    """
    signature_validator = RSASignatureValidator(private_key)
    validators = [
        RecordSizeValidator(),
        SwarmKeyValidator(swarm_key_rules(run_id)),
        SchemaValidator(MetricsSchema, prefix=run_id),
        SchemaValidator(FingerprintsSchema, prefix=run_id),
        SchemaValidator(ReachableSchema, prefix=run_id),
        signature_validator,
        *extra,
    ]
    return validators, signature_validator.local_public_key


def publish_metrics(
    dht: hivemind.DHT, run_id: str, public_key: bytes, metrics: LocalMetrics, expiration: float = METRICS_EXPIRATION
):
    """Store this peer's metrics without blocking the training loop; returns a future."""
    return _store_own_entry(dht, metrics_key(run_id), public_key, metrics, expiration)


def _store_own_entry(dht: hivemind.DHT, key: str, public_key: bytes, value: pydantic.BaseModel, expiration: float):
    """This peer's signed entry under ``key`` (subkey: its public key), stored in the background; returns a future."""
    return dht.store(
        key=key,
        subkey=public_key,
        value=value.dict(),
        expiration_time=get_dht_time() + expiration,
        return_future=True,
    )


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


def publish_fingerprints(dht: hivemind.DHT, run_id: str, public_key: bytes, record: RoundFingerprints):
    """Store this trainer's round fingerprints without blocking the training loop; returns a future."""
    return _store_own_entry(dht, fingerprints_key(run_id), public_key, record, FINGERPRINT_EXPIRATION)


def fetch_fingerprints(dht: hivemind.DHT, run_id: str, epoch: int, timeout: float) -> Dict[bytes, RoundFingerprint]:
    """peer ID -> that peer's fingerprint of ``epoch``, for every well-formed record. Every record is untrusted:
    malformed ones are skipped, and a peer ID claimed by two records counts for neither (which one is real cannot be
    told)."""
    found: Dict[bytes, RoundFingerprint] = {}
    claimed: Dict[bytes, int] = {}
    for entry in _latest(dht, fingerprints_key(run_id), timeout).values():
        try:
            record = RoundFingerprints.parse_obj(entry.value)
        except (pydantic.ValidationError, TypeError):
            continue
        claimed[record.peer_id] = claimed.get(record.peer_id, 0) + 1
        rounds = [r for r in record.rounds if r.epoch == epoch]
        if rounds:
            found[record.peer_id] = rounds[-1]
    return {peer_id: found_round for peer_id, found_round in found.items() if claimed[peer_id] == 1}


def publish_reachable(dht: hivemind.DHT, run_id: str, public_key: bytes, record: ReachablePeer):
    """Announce that this peer can be dialled (in the background); returns a future."""
    return _store_own_entry(dht, reachable_key(run_id), public_key, record, REACHABLE_EXPIRATION)


def fetch_reachable(dht: hivemind.DHT, run_id: str, timeout: float) -> List[ReachablePeer]:
    """Every well-formed, fresh announcement of a reachable peer. Untrusted like every record: malformed ones are
    skipped, and a peer ID claimed by two records counts for neither (which one is real cannot be told)."""
    now = get_dht_time()
    found: Dict[bytes, ReachablePeer] = {}
    claimed: Dict[bytes, int] = {}
    for entry in _latest(dht, reachable_key(run_id), timeout).values():
        try:
            record = ReachablePeer.parse_obj(entry.value)
        except (pydantic.ValidationError, TypeError):
            continue
        if not now - REACHABLE_EXPIRATION <= record.time <= now + MAX_CLOCK_SKEW:
            continue
        claimed[record.peer_id] = claimed.get(record.peer_id, 0) + 1
        found[record.peer_id] = record
    return [record for peer_id, record in found.items() if claimed[peer_id] == 1]


# --------------------------------------------------------------------------- records hivemind writes


@dataclass(frozen=True)
class PeerProgress:
    """One peer's training progress record (written by hivemind's ProgressTracker)."""

    peer_id: bytes
    epoch: int
    client_mode: bool
    time: float  # DHT time of the report


def _latest(dht: hivemind.DHT, key: str, timeout: Optional[float]) -> dict:
    found = dht.get(key, latest=True, return_future=timeout is not None)
    if timeout is not None:
        found = found.result(timeout)
    return found.value if found is not None and isinstance(found.value, dict) else {}


def read_progress(dht: hivemind.DHT, run_id: str, timeout: Optional[float] = None) -> List[PeerProgress]:
    """Every well-formed progress record of the run (malformed entries are skipped)."""
    records = []
    for entry in _latest(dht, progress_key(run_id), timeout).values():
        value = entry.value
        if not isinstance(value, dict):
            continue
        peer_id, epoch, client, when = (value.get(name) for name in ("peer_id", "epoch", "client_mode", "time"))
        if isinstance(peer_id, bytes) and isinstance(epoch, int) and isinstance(when, (int, float)):
            records.append(PeerProgress(peer_id, epoch, bool(client), float(when)))
    return records


def read_averager_declarations(dht: hivemind.DHT, prefix: str, timeout: Optional[float] = None) -> List[bytes]:
    """Peer IDs (bytes) that declared an averager under ``prefix`` (sharing its state or not, e.g. priority None)."""
    return [peer_id for peer_id in _latest(dht, f"{prefix}.all_averagers", timeout) if isinstance(peer_id, bytes)]


def read_state_sharing(dht: hivemind.DHT, run_id: str, timeout: Optional[float] = None) -> Dict[bytes, float]:
    """peer ID bytes -> state-sharing priority of every peer that currently offers its state."""
    return {
        peer_id: float(entry.value)
        for peer_id, entry in _latest(dht, state_sharing_key(run_id), timeout).items()
        if isinstance(entry.value, (int, float))
    }
