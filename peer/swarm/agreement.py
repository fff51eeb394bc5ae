"""--sync_mode local: every trainer ends each round with the same shared parameters, also after a fault.

hivemind can end an all-reduce "successfully" with peers holding different results: when a peer dies while it
reduces a shard, each survivor keeps its own pseudo-gradient in that shard (a failed reducer). In synchronous mode
that costs one gradient step; here the survivors' shared parameters (and outer momentum) stay apart until the next
state averaging round. This module finds and repairs such a disagreement, with one rule every peer computes alike:

1. Right after each round, every trainer that serves its state (not a client) publishes a fingerprint of its shared
   parameters and outer optimizer state (a signed record, ``peer.swarm.records.RoundFingerprints``):
   ``FINGERPRINT_SIZE`` values at fixed, evenly spaced positions of the concatenated shared parameters and outer
   momentum buffers. The momentum counts: state averaging averages parameters only, so two peers whose momentum
   differs (one ended a round alone) show equal parameters after each state averaging round while every outer step
   moves them apart again. A shard of an all-reduce is a contiguous span of
   that vector, so a diverged shard shows in the sample. A peer whose state was replaced during the round (it
   joined, re-synced, repaired) publishes none for it: its round started from another base; it only follows.
2. ``SETTLE_SECONDS`` later (at its next local step, at the latest when its next round ends), every trainer reads
   that round's fingerprints and votes (``choose_reference``): the fingerprint the most peers agree with (within
   the tolerance) wins, ties go to the lowest peer ID; a trainer that published no record of the round (1, 5)
   casts no vote of its own, it only follows. Only records of the same epoch that ended within
   ``SAME_ROUND_SECONDS`` of this peer's count: the peers of one all-reduce end it together, while a peer one epoch
   behind (hivemind lets a peer lag one epoch, e.g. a joiner that loaded the state just before the others ended a
   round) labels a different round with the same epoch; it is not compared, it is caught up by its own check.
3. A trainer whose own fingerprint is not within the tolerance of the winner's downloads the state of a peer that
   agrees with the winner (only from those, and only if they declared their state), once for that round; if that
   fails it trains on (the next state averaging round or check pulls it back).
4. A peer that finds no record of its own epoch from its round, but records labelled one epoch further that ended
   within ``SAME_ROUND_SECONDS`` of its round (the same all-reduce) and disagree with it, is a round behind: it
   loaded the state while the others were ending a round, and averaged a pseudo-gradient of the older base. It
   downloads from them (their epoch is ahead, so hivemind accepts their state; the reverse would be refused).

5. A peer that missed the round (its all-reduce failed and it dropped the round, ``LeanHiveOptimizer._missed``)
   publishes none either, and follows the records of that epoch that ended up to ``missed_round_seconds`` before
   or after its attempt gave up (an attempt fails only when its wait is over): if peers made the round, their
   shared parameters moved by an outer step and it downloads theirs. With no record to follow, nobody made the
   round that can be served (two peers that found no group, or clients with each other: a client publishes no
   record, and a group of it and aux peers only fails while other trainers train) and nothing is loaded.

Every record is untrusted: the schema bounds its size, a peer ID claimed twice counts for neither, a sample with
NaN/inf values or of the wrong size is ignored, and a vote can only make a peer download once per round from peers
that declared their state (the download itself is checked as any other, see LeanHiveStateAverager).

Tolerance: with ``--compression none`` peers that agree differ by float rounding only (a state averaging round
adds ~1e-8), so 1e-6 (the issue's criterion). Lossy compression sends each peer its own rounding of the averaged
update, so peers drift apart by the quantization error; only a larger disagreement is repaired there.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import hivemind
import torch
from hivemind.utils import get_dht_time

from peer.swarm.records import (
    FINGERPRINT_HISTORY,
    FINGERPRINT_SIZE,
    RoundFingerprint,
    RoundFingerprints,
    fetch_fingerprints,
    publish_fingerprints,
)

logger = logging.getLogger(__name__)

SETTLE_SECONDS = 1.5
"""Wait this long after a round before reading its fingerprints: the peers of one all-reduce end it within a
fraction of a second of each other, and a store reaches the DHT within that on any link the swarm trains over.
Short enough that a peer repairs in the middle of the next round (it then takes part in that round's all-reduce
with the winners' state) rather than at its end."""
SAME_ROUND_SECONDS = 1.0
"""Records whose round ended further apart than this are from different rounds (see the module docstring)."""
LOSSLESS_TOLERANCE = 1e-6
LOSSY_TOLERANCE = 1e-2
READ_TIMEOUT = 5.0


def tolerance_for(compression: str) -> float:
    """The largest difference of a fingerprint value two peers in agreement may show (see the module docstring)."""
    return LOSSLESS_TOLERANCE if compression == "none" else LOSSY_TOLERANCE


def sample_positions(total: int, size: int = FINGERPRINT_SIZE) -> torch.Tensor:
    """``size`` evenly spaced positions in a vector of ``total`` values (the same on every peer of a run)."""
    return ((torch.arange(size, dtype=torch.float64) + 0.5) * total / size).long().clamp_max(max(total - 1, 0))


@torch.no_grad()
def fingerprint(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``FINGERPRINT_SIZE`` float32 values sampled from the concatenation of ``tensors`` (in their order)."""
    sizes = [t.numel() for t in tensors]
    positions = sample_positions(sum(sizes))
    values, start = [], 0
    for tensor, size in zip(tensors, sizes):
        inside = positions[(positions >= start) & (positions < start + size)] - start
        if len(inside):
            values.append(tensor.detach().reshape(-1)[inside.to(tensor.device)].to("cpu", torch.float32))
        start += size
    return torch.cat(values) if values else torch.zeros(FINGERPRINT_SIZE)


def decode_sample(raw: bytes) -> Optional[torch.Tensor]:
    """A fingerprint from its record; None if malformed (wrong size, NaN/inf)."""
    if not isinstance(raw, bytes) or len(raw) != 4 * FINGERPRINT_SIZE:
        return None
    sample = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    return sample if bool(torch.isfinite(sample).all()) else None


def agree(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    return bool((a - b).abs().max() <= tolerance)


def choose_reference(fingerprints: Mapping[bytes, torch.Tensor], tolerance: float) -> Optional[bytes]:
    """The peer whose fingerprint wins the vote: the most peers within ``tolerance`` of it (itself included), ties
    to the lowest peer ID. Depends only on the set of records, so every peer that read the same set picks the
    same one. None when there are none."""
    if not fingerprints:
        return None
    support = {
        peer: sum(agree(sample, other, tolerance) for other in fingerprints.values())
        for peer, sample in fingerprints.items()
    }
    return min(fingerprints, key=lambda peer: (-support[peer], peer))


def sources_to_follow(
    own: torch.Tensor, own_peer: Optional[bytes], fingerprints: Mapping[bytes, torch.Tensor], tolerance: float
) -> List[bytes]:
    """The peers to download the state from (those agreeing with the winner), or [] when this peer agrees with the
    winner or nobody voted. ``own_peer``: this peer's ID if it voted (its record is counted), else None."""
    votes = dict(fingerprints)
    if own_peer is not None:
        votes[own_peer] = own  # as published: the DHT may not return it yet
    winner = choose_reference(votes, tolerance)
    if winner is None or agree(own, votes[winner], tolerance):
        return []
    return sorted(
        peer for peer, sample in votes.items() if peer != own_peer and agree(sample, votes[winner], tolerance)
    )


class RoundAgreement:
    """One trainer's part of the protocol (module docstring); the trainer calls ``round_ended`` after each round
    and ``check`` when ``due`` (or at the next round's end), and downloads from what ``check`` returns."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        public_key: bytes,
        shared: Sequence[torch.Tensor],
        outer_state: Callable[[], Sequence[torch.Tensor]] = tuple,
        *,
        votes: bool,
        tolerance: float,
        missed_round_seconds: float = SAME_ROUND_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.dht, self.run_id, self.public_key, self.shared = dht, run_id, public_key, tuple(shared)
        self.outer_state = outer_state  # read at each round's end: a state download replaces these tensors
        self.votes, self.tolerance, self.clock = votes, tolerance, clock
        self.missed_round_seconds = max(SAME_ROUND_SECONDS, missed_round_seconds)
        self.peer_id = dht.peer_id.to_bytes()
        self._history: deque = deque(maxlen=FINGERPRINT_HISTORY)
        # epoch, own, ended (clock, DHT), how far apart the others' records of the round may have ended, and
        # whether this peer voted in it (published its record)
        self._pending: Optional[Tuple[int, torch.Tensor, float, float, float, bool]] = None
        self.records_compared = 0  # the other peers' fingerprints the last check compared with (same or next epoch)

    def round_ended(self, epoch: int, state_replaced: bool, missed: bool = False) -> None:
        """The round that ended at ``epoch`` is over: fingerprint it, and publish unless this peer's state was
        replaced during it or it ``missed`` the round (its all-reduce failed and it dropped the round); then it only
        follows the vote of the peers that made it, whose round may have ended up to ``missed_round_seconds``
        before this peer's attempt gave up."""
        own, ended = fingerprint([*self.shared, *self.outer_state()]), get_dht_time()
        window = self.missed_round_seconds if missed else SAME_ROUND_SECONDS
        voted = self.votes and not state_replaced and not missed
        self._pending = (epoch, own, self.clock(), ended, window, voted)
        if not voted:
            return
        self._history.append(RoundFingerprint(epoch=epoch, ended=ended, sample=own.numpy().tobytes()))
        record = RoundFingerprints(peer_id=self.peer_id, rounds=list(self._history))
        publish_fingerprints(self.dht, self.run_id, self.public_key, record)

    def due(self) -> bool:
        return self._pending is not None and self.seconds_until_due() <= 0

    def seconds_until_due(self) -> float:
        """Seconds until the pending round's check may read the others' fingerprints (0 when nothing is pending)."""
        return max(0.0, SETTLE_SECONDS - (self.clock() - self._pending[2])) if self._pending is not None else 0.0

    def pending(self) -> bool:
        return self._pending is not None

    def check(self) -> Tuple[Optional[int], List[bytes]]:
        """Read the pending round's fingerprints and vote: (that round's epoch, the peers to download from; [] when
        this peer agrees with the winner)."""
        if self._pending is None:
            return None, []
        epoch, own, _, ended, window, voted = self._pending
        self._pending, self.records_compared = None, 0
        try:
            same = fetch_fingerprints(self.dht, self.run_id, epoch, timeout=READ_TIMEOUT)
            later = fetch_fingerprints(self.dht, self.run_id, epoch + 1, timeout=READ_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - the DHT may be unreachable for a moment: skip this round's check
            logger.info("Could not read the round fingerprints of epoch %d: %r", epoch, e)
            return epoch, []
        logger.debug(
            "Round to epoch %d ended at %.2f; records of that epoch ended at %s, of the next at %s",
            epoch,
            ended,
            sorted(round(r.ended, 2) for r in same.values()),
            sorted(round(r.ended, 2) for r in later.values()),
        )
        others, ahead = self._same_round(same, ended, window), self._same_round(later, ended, SAME_ROUND_SECONDS)
        self.records_compared = len(others) + len(ahead)
        ahead = [peer for peer, sample in ahead.items() if not agree(own, sample, self.tolerance)]
        if ahead and not others:
            # the same all-reduce, but labelled one epoch further: this peer loaded the state while the others were
            # ending a round, so it averaged a pseudo-gradient of an older base; theirs is the swarm's state
            logger.warning(
                "Ended the round to epoch %d together with %d peer(s) already at epoch %d, with other shared "
                "parameters (this peer joined a round late): downloading their state",
                epoch,
                len(ahead),
                epoch + 1,
            )
            return epoch, sorted(ahead)
        # a peer that did not vote (it dropped the round, or its state was replaced) only follows: counting its own
        # fingerprint would let it win a tie with the one peer that made the round (ties go to the lowest ID)
        sources = sources_to_follow(own, self.peer_id if voted else None, others, self.tolerance)
        if sources:
            logger.warning(
                "Shared parameters after the round to epoch %d differ from the %d peer(s) that won the vote "
                "(%d fingerprints read): downloading their state",
                epoch,
                len(sources),
                len(others) + 1,
            )
        return epoch, sources

    def _same_round(
        self, records: Mapping[bytes, RoundFingerprint], ended: float, window: float
    ) -> Dict[bytes, torch.Tensor]:
        """The other peers' well-formed fingerprints of a round that ended within ``window`` seconds of ours."""
        found = {}
        for peer, record in records.items():
            decoded = decode_sample(record.sample)
            if decoded is not None and peer != self.peer_id and abs(record.ended - ended) <= window:
                found[peer] = decoded
        return found
