"""A hostile peer as its own process: it joins a run's DHT and keeps writing properly signed but hostile records,
and squats the keys the swarm reads. Run with ``python -m benchmarks.testbed.rogue_records --initial_peers ... --run_id
...``; it emits ``rogue_ready`` (``--events_file``) after its first round and runs until it is stopped.

Each round (every ``--period`` seconds) it writes, under keys of its own (several RSA identities, each signs its
records properly so that the signature and schema validators accept them):

- progress records claiming ``epoch=10**12`` (one with an expiration years ahead, one with a normal one), a record
  at the swarm's current epoch claiming ``samples_per_second=1e300``, and one whose ``time`` is a week ahead;
- metrics records claiming ``epoch=10**12``, and one at the current epoch whose ``time`` is a week ahead;
- plain values with an expiration years ahead under the state-sharing and matchmaking keys (key squatting).

With ``--behind`` it writes, instead, one progress record far behind the swarm (epoch 0) with a plausible
throughput: beside a lone honest trainer it is half the votes, and must not make that trainer take a state of its
choice (``LeanHiveProgressTracker.apart_from_swarm``).

With ``--health`` it writes, instead, metrics records at the swarm's epoch whose round health is hostile: under
one key, totals that grow by ten million rounds and a petabyte each round (within the schema's bounds for a while,
never within what the elapsed time allows); under another, totals past the schema's bounds.

Records go straight to every peer in its routing table (``raw_store``) as well as through its own DHT.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import hivemind
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.testbed.faults.dht_records import craft, owner_marker, raw_store, signed
from peer.swarm import events
from peer.swarm.hivemind_seam import routing_table_peers
from peer.swarm.keys import averager_prefixes, metrics_key, progress_key
from peer.swarm.records import LocalMetrics, make_validators, read_progress

logger = logging.getLogger("rogue_records")

YEARS = 10 * 365 * 86400.0
WEEK = 7 * 86400.0
HUGE_EPOCH = 10**12


def honest_epoch(dht: hivemind.DHT, run_id: str) -> int:
    try:
        records = read_progress(dht, run_id, timeout=5)
    except Exception as e:  # noqa: BLE001 - keep misbehaving with the last guess
        logger.info("could not read the swarm's progress: %r", e)
        records = []
    epochs = [r.epoch for r in records if not r.client_mode and r.epoch < HUGE_EPOCH]
    return statistics.median_low(epochs) if epochs else 0


def progress_value(dht: hivemind.DHT, epoch: int, sps: float, when: float) -> dict:
    return LocalTrainingProgress(
        peer_id=dht.peer_id.to_bytes(),
        epoch=epoch,
        samples_accumulated=0,
        samples_per_second=sps,
        time=when,
        client_mode=False,
    ).dict()


def metrics_value(epoch: int, when: float) -> dict:
    return LocalMetrics(
        epoch=epoch, samples_per_second=1e6, samples_accumulated=64, loss=999.0, mini_steps=4, time=when
    ).dict()


def health_value(epoch: int, when: float, round_index: int, out_of_bounds: bool) -> dict:
    grown = 10**7 * (round_index + 1)
    health = dict(
        rounds_joined=grown,
        rounds_ok=grown,
        failed_no_group=0,
        failed_timeout=0,
        failed_partial=0,
        last_group_size=2,
        compute_seconds=float(grown),
        wait_seconds=0.0,
        matchmaking_seconds=0.0,
        allreduce_seconds=0.0,
        optimizer_seconds=0.0,
        bytes_sent=10**18 if out_of_bounds else 10**15 * (round_index + 1),
        bytes_received=0,
        reachability="public",
        sync_mode="sync",
        version="0.1.0",
    )
    return {**metrics_value(epoch, when), "samples_total": 64 * (round_index + 1), "health": health}


def one_round(dht: hivemind.DHT, run_id: str, keys: list, squat: bool, health_round=None, behind=False) -> int:
    now = get_dht_time()
    if behind:  # needs no honest epoch: skip that DHT read
        progress, metrics = [(keys[0], progress_value(dht, 0, 50.0, now), now + 60)], []
        return _store_everywhere(dht, _signed_records(run_id, progress, metrics, now))
    epoch = honest_epoch(dht, run_id)
    progress = [
        (keys[0], progress_value(dht, HUGE_EPOCH, 1.0, now), now + YEARS),
        (keys[1], progress_value(dht, HUGE_EPOCH, 1.0, now), now + 60),
        (keys[2], progress_value(dht, epoch, 1e300, now), now + 60),
        (keys[3], progress_value(dht, epoch, 1e300, now + WEEK), now + 60),
    ]
    metrics = [
        (keys[0], metrics_value(HUGE_EPOCH, now), now + 300),
        (keys[1], metrics_value(max(epoch - 1, 0), now + WEEK), now + 300),
    ]
    if health_round is not None:
        progress = []
        metrics = [
            (keys[0], health_value(epoch, now, health_round, out_of_bounds=False), now + 300),
            (keys[1], health_value(epoch, now, health_round, out_of_bounds=True), now + 300),
        ]
    records = _signed_records(run_id, progress, metrics, now)
    if squat:
        for prefix in averager_prefixes(run_id):
            for key in (f"{prefix}.all_averagers", f"{prefix}.0b"):
                records.append(craft(key, None, {"squatted": True}, ttl=YEARS))
    accepted = _store_everywhere(dht, records)
    if squat:  # plain values, also kept by the rogue's own node (it answers gets for the key)
        for prefix in averager_prefixes(run_id):
            for key in (f"{prefix}.all_averagers", f"{prefix}.0b"):
                dht.store(key, {"squatted": True}, expiration_time=now + YEARS)
    return accepted


def _signed_records(run_id: str, progress: list, metrics: list, now: float) -> list:
    # the signature covers the expiration: craft each record with its own lifetime, then sign it
    records = [signed(craft(progress_key(run_id), owner_marker(k), v, ttl=e - now), k) for k, v, e in progress]
    records += [signed(craft(metrics_key(run_id), owner_marker(k), v, ttl=e - now), k) for k, v, e in metrics]
    return records


def _store_everywhere(dht: hivemind.DHT, records: list) -> int:
    """Store ``records`` straight at every peer in the routing table; the number of stores they accepted."""
    accepted = 0
    for peer in dht.run_coroutine(routing_table_peers):
        for record in records:
            try:
                accepted += bool(raw_store(dht, peer, record, timeout=10))
            except Exception as e:  # noqa: BLE001 - a peer that hangs up on us is fine
                logger.debug("store to %s failed: %r", peer, e)
    return accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--initial_peers", nargs="+", required=True)
    parser.add_argument("--run_id", required=True)
    parser.add_argument("--period", type=float, default=2.0)
    parser.add_argument("--no_squat", action="store_true", help="only write hostile signed records")
    parser.add_argument("--health", action="store_true", help="write metrics records with hostile round health only")
    parser.add_argument("--behind", action="store_true", help="write one progress record at epoch 0 only")
    parser.add_argument("--events_file", default=None)
    parser.add_argument(
        "--start_after",
        type=Path,
        default=None,
        help="join only once this file exists: a test starts the process early, so that its start-up on a busy "
        "machine does not eat the swarm's epochs before the first hostile round",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rogue %(message)s")
    events.open_events(args.events_file)
    if args.start_after is not None:
        while not args.start_after.exists():
            time.sleep(0.1)
    # the run's validators strip signatures from what it reads (its own node keeps whatever it stores itself)
    validators, _ = make_validators(args.run_id, RSAPrivateKey())
    dht = hivemind.DHT(
        start=True, initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=validators
    )
    keys = [RSAPrivateKey() for _ in range(4)]
    first, rounds = True, 0
    while True:
        accepted = one_round(
            dht,
            args.run_id,
            keys,
            squat=not (args.no_squat or args.health or args.behind),
            health_round=rounds if args.health else None,
            behind=args.behind,
        )
        rounds += 1
        logger.info("round done: %d records accepted by honest peers", accepted)
        if first:
            events.emit("rogue_ready", accepted=accepted)
            first = False
        time.sleep(args.period)


if __name__ == "__main__":
    main()
