"""Robust averaging: a bound on every peer's contribution, enforced by the peer that receives it.

hivemind averages with a butterfly all-reduce: each peer reduces one shard of the vector and receives
every other peer's part of that shard. Plain averaging lets one broken or hostile peer decide the
result: a NaN/inf part makes the whole shard NaN for everyone, a part 1e6x too large dominates it.
Here the reducer keeps every sender's part and aggregates them with a centered clip:

- parts with NaN/inf values are dropped;
- center = coordinate-wise median of the remaining parts;
- each part's deviation from the center is clipped to ``clip_factor`` x the median deviation norm (norms
  compared after scaling by sqrt(sample weight): a part averaged over more samples deviates less by chance);
- result = center + weighted mean of the clipped deviations.

When nothing is clipped this is exactly the weighted mean, so honest swarms average as before.
A contribution can move the result by at most ``clip_factor`` x median deviation / group size.

Sample weights come from the senders and are bounded too (``bounded_weights``): NaN or negative weights count as 0,
and no weight may exceed ``MAX_WEIGHT_RATIO`` x the lower median weight (an ``inf`` or 1e300 weight would turn
every shard into NaN, which receivers refuse: averaging would be silently off). A part whose shape is not the shard's
is dropped by the reducer (hivemind's sum would broadcast a 1-element part into the whole shard, and a stacked median
would fail the round for everyone).

With two contributors the median cannot tell the faulty one, so each receiver bounds what the other can do to it
(``bound_two_peer_update``): the averaged update of a tensor may move it by at most ``TWO_PEER_PULL`` x the norm of
the receiver's own contribution, so the result never points against it (a peer sending -1e3 x its gradient can
cancel this peer's step at worst, not reverse it). Honest pairs are not bounded unless their gradients differ by
more than twice the receiver's own norm.

Threat model (honest about the limits): the bound holds while fewer than half of the peers in a round
are faulty (with two peers, one of which is faulty, no rule can tell which one is right); a hostile
peer that reduces a shard can still return wrong finite values for that shard (1/n of the vector),
only non-finite results are refused on receipt (the local values are kept); a sample weight can claim at
most ``MAX_WEIGHT_RATIO`` x the lower median weight of its round.

The hivemind side (the reducer that keeps every part, the all-reduce runner) is in peer.swarm.hivemind_seam.
"""

from __future__ import annotations

import logging
import math
from typing import List, Sequence

import torch

logger = logging.getLogger(__name__)

DEFAULT_CLIP_FACTOR = 4.0
MAX_WEIGHT_RATIO = 100.0
"""No sender's weight counts for more than this many times the lower median weight of the round (honest peers
differ in samples per epoch, rarely by 100x; a hostile one may claim inf)."""
TWO_PEER_PULL = 8.0
"""With two contributors, the averaged update may move a tensor by at most this x the receiver's own norm (and
never so that the result points against the receiver's own contribution). Loose on purpose: the two peers of an
honest pair apply the same average only when neither bound triggers, and two honest gradients of noisy
micro-batches can differ by more than their norms (a bound of 1x fired on most honest rounds)."""


def bounded_weights(weights: Sequence[float]) -> List[float]:
    """Sender-claimed weights made safe to average with: NaN/negative -> 0, each capped at ``MAX_WEIGHT_RATIO`` x
    the lower median positive weight, and rescaled so that the lower median is 1 (sums stay finite in float32)."""
    positive = sorted(w for w in weights if math.isfinite(w) and w > 0)
    if not positive:
        return [0.0 for _ in weights]
    reference = positive[(len(positive) - 1) // 2]
    bounded = [min(w / reference, MAX_WEIGHT_RATIO) if w > 0 else 0.0 for w in weights]  # NaN > 0 is False
    changed = sum(1 for w in weights if not (w >= 0 and w / reference <= MAX_WEIGHT_RATIO))
    if changed:
        logger.warning(
            "Averaging: bounded %d of %d sample weights (NaN/negative/inf or over %gx the median: %s)",
            changed,
            len(weights),
            MAX_WEIGHT_RATIO,
            ", ".join(f"{w:.3g}" for w in weights),
        )
    return bounded


def bound_two_peer_update(update: torch.Tensor, own: torch.Tensor) -> bool:
    """Bound ``update`` (average - own, in place) for a round of two contributors, where the median rule cannot
    tell which one is faulty; True if it changed.

    1. The result (own + update) never points against ``own``: its component against ``own`` is removed (a peer
       sending -1e3 x its gradient can cancel our update, not reverse it).
    2. ||update|| <= ``TWO_PEER_PULL`` x ||own|| (scaling down keeps 1: <own + s u, own> >= (1 - s) ||own||^2)."""
    own = own.to(update.dtype)
    own_sq = float(torch.dot(own.flatten(), own.flatten()))
    changed = False
    if own_sq == 0.0:  # nothing of ours to measure against: keep our (zero) contribution
        changed = bool(update.any())
        update.zero_()
        return changed
    along = own_sq + float(torch.dot(update.flatten(), own.flatten()))  # <own + update, own>
    if along < 0:
        update.sub_(own, alpha=along / own_sq)
        changed = True
    bound = TWO_PEER_PULL * math.sqrt(own_sq)
    norm = float(update.norm())
    if norm > bound:
        update.mul_(bound / norm)
        changed = True
    return changed


def _median(stacked: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median along dim 0; the mean of the two middle values for an even count."""
    ordered = stacked.sort(dim=0).values
    count = ordered.shape[0]
    return (ordered[(count - 1) // 2] + ordered[count // 2]) / 2


def bounded_mean(parts: Sequence[torch.Tensor], weights: Sequence[float], clip_factor: float) -> torch.Tensor:
    """Weighted mean of ``parts`` with NaN/inf parts dropped, weights bounded (``bounded_weights``) and each part's
    deviation from the median bounded.

    ``clip_factor`` <= 0 gives the plain weighted mean (no bound, non-finite parts still dropped).
    All parts non-finite: NaN, which receivers refuse (they keep their local values).
    """
    weights = bounded_weights(weights)
    finite = [(part, weight) for part, weight in zip(parts, weights) if bool(torch.isfinite(part).all())]
    if len(finite) < len(parts):
        logger.warning(
            "Averaging: dropped %d of %d contributions with NaN/inf values", len(parts) - len(finite), len(parts)
        )
    if not finite:
        return torch.full_like(parts[0], float("nan"))
    # zero-weight parts (a peer that just loaded the state tags along with weight 0) add nothing to the mean;
    # left in, they would drag the median towards their stale values and get honest parts clipped
    kept = [(part, weight) for part, weight in finite if weight > 0] or finite
    stacked = torch.stack([part for part, _ in kept])
    weight = torch.tensor([w for _, w in kept], dtype=stacked.dtype)
    total = float(weight.sum())
    if clip_factor <= 0 or len(kept) == 1:
        return (stacked * weight.view(-1, *[1] * (stacked.ndim - 1))).sum(0) / total if total > 0 else stacked[0]
    center = _median(stacked)
    deviations = stacked - center
    # a peer that averaged more samples deviates less by chance: compare norms scaled by sqrt(weight)
    noise_scale = (weight / _median(weight.view(-1, 1))[0]).clamp_min(1e-12).sqrt()
    norms = deviations.flatten(1).norm(dim=1) * noise_scale
    # upper median: an honest peer's; never below float32 rounding noise of the center (identical parts)
    noise_floor = 1e-6 * float(center.norm())
    bound = max(clip_factor * float(norms.sort().values[len(kept) // 2]), noise_floor)
    scale = torch.where(norms > bound, bound / norms.clamp_min(1e-30), torch.ones_like(norms))
    clipped = int((norms > bound).sum())
    if clipped:
        severe = float(norms.max()) > 10 * bound
        logger.log(
            logging.WARNING if severe else logging.INFO,
            "Averaging: bounded %d of %d contributions (deviation up to %.3g, bound %.3g; deviations %s, norms %s, "
            "weights %s)",
            clipped,
            len(kept),
            float(norms.max()),
            bound,
            _numbers(norms),
            _numbers(stacked.flatten(1).norm(dim=1)),
            _numbers(weight),
        )
    if total <= 0:
        return center
    factors = (scale * weight / total).view(-1, *[1] * (stacked.ndim - 1))
    return center + (deviations * factors).sum(0)


def _numbers(values: torch.Tensor, at_most: int = 8) -> str:
    """For the log: tells a hostile outlier from honest peers that differ in samples (weights) or from agreeing
    parameters (a state averaging round: norms of whole parameters, deviations at float rounding)."""
    text = ", ".join(f"{float(v):.3g}" for v in values[:at_most])
    return text + (", ..." if len(values) > at_most else "")


def keep_local_where_not_finite(update: torch.Tensor) -> int:
    """``update`` is (average - local value): a NaN/inf there would poison our tensor, so use 0 (keep ours).

    Returns how many values were refused."""
    bad = ~torch.isfinite(update)
    count = int(bad.sum())
    if count:
        update.masked_fill_(bad, 0.0)
    return count
