"""The state download from several donors at once, part by part, verified (``peer.swarm.state_parts``).

A mixin of ``LeanHiveStateAverager`` (its RPC and its download run in the averager process hivemind forks):

- ``rpc_download_state_part`` (a new RPC; hivemind's ``DownloadData`` message both ways, its ``metadata`` field
  carrying a small msgpack request/answer): ``{"part": None}`` asks for the donor's manifest (epoch, sizes, digests,
  and the metadata it covers); ``{"part": i, "root": r}`` for part ``i`` of the snapshot whose root digest is ``r``
  (``"gone"`` once the donor dropped that snapshot). A donor serves at most ``serve_max_joiners`` joiners at a time
  (a joiner counts until it was idle ``JOINER_IDLE`` s or said goodbye); others get ``"busy"`` at once and ask
  another donor. While this peer's averaging round runs (``round_running``, set by the host around the gradient
  round and by this process around the state averaging round) serving pauses between chunks: the download yields to
  the round.
- ``rpc_download_state`` (hivemind's whole-state stream) is admitted by the same bound.
- ``_download_in_parts``: manifests from up to ``max_donors + 2`` candidates; donors are grouped by root digest and
  the largest group is used (a donor alone against a majority is named and left out); up to ``max_donors`` of its
  donors fetch disjoint parts at once (``PartSchedule``), each part checked (size, digest) before it is kept; a donor
  that fails or answers late leaves this try and its parts move to the others (a reserve donor of the group steps
  in); the request's next try may ask it again and resumes. A donor that serves a part whose digest differs from the
  manifest is excluded for the rest of the request. The complete state is checked as a whole
  (``check_downloaded_state``) before it is handed over. Parts already verified are kept for the next try or request
  of the same root (the same epoch): a cut-off download resumes with the missing ones.

The manifest and every part come over the libp2p connection to the donor's peer ID (its secure channel is keyed by
the donor's identity key): a wrong part is attributable to the donor that announced the digest it breaks.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from typing import AsyncIterator, Dict, List, Optional, Set

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from peer.swarm.state_parts import Manifest, PartSchedule, digest, flatten, group_by_root, part_bytes_for, unflatten

logger = logging.getLogger("peer.swarm.hivemind_seam.averaging")  # one logger for every state download line

JOINER_IDLE = 15.0
"""Seconds after a joiner's last request when it no longer counts against ``serve_max_joiners``."""
SNAPSHOT_REUSE = 1.0
"""A manifest request within this many seconds of the last snapshot reuses it (joiners asking together share one).
Short: the snapshot is not told when the donor's epoch moves, and a swarm of small states ends an epoch every few
seconds; a longer reuse served an aux peer the same old epoch for 10 s on end."""
SNAPSHOT_KEEP = 60.0
"""A snapshot unused this long is dropped (it holds a copy of the state)."""
MAX_SNAPSHOTS = 2
"""Snapshots kept at once: the current one and the one joiners may still be fetching."""
SERVE_CHUNK = 1 << 20
"""Bytes per message while serving a part."""
MAX_YIELD_PER_CHUNK = 10.0
"""Longest pause before each chunk while a round runs (below the joiner's 20 s wait for a next chunk)."""
SPARE_MANIFESTS = 2
"""Manifests asked beyond ``max_donors``: reserves, and votes that outnumber one donor with a wrong root."""
LAGGING_DONOR_WAIT = 5.0
"""Longest wait for donors one epoch behind to end their round (``_await_lagging_donors``): a round's end, not a
download's length."""
LAGGING_ASK_EVERY = 1.5
"""Seconds between asks of a lagging donor: longer than ``SNAPSHOT_REUSE``, so that it answers with a new snapshot."""


class PartRefused(Exception):
    """A donor answered a part request with ``busy``, ``gone`` or ``withheld``."""


class StateWithheld(ValueError):
    """This peer does not serve its state now (the message says why); a joiner is told ``withheld`` and asks again
    after a pause, as when a donor is busy. Raised by the host's ``get_current_state``."""


class NoPartDonors(Exception):
    """No candidate answered a manifest request (peers without the RPC): the whole-state stream is used instead."""


class _Snapshot:
    def __init__(self, manifest: Manifest, metadata_bytes: bytes, buffer: torch.Tensor):
        self.manifest, self.metadata_bytes, self.buffer = manifest, metadata_bytes, buffer
        self.taken = self.used = time.monotonic()


class PartedStateTransfer:
    """See the module docstring. Mixed into ``LeanHiveStateAverager`` before hivemind's classes."""

    serve_part_bytes: Optional[int] = None
    """None: ``part_bytes_for`` the state's size (tests and benchmarks set a size)."""
    serve_max_joiners: int = 2

    def __init__(self, *args, **kwargs):
        # before hivemind's __init__ forks the averager process (which serves and downloads)
        self.round_running = mp.Event()
        """Set while this peer averages (the host sets it around the gradient round): serving yields to it."""
        self._joiners: Dict[PeerID, float] = {}
        self._snapshots: Dict[bytes, _Snapshot] = {}
        self._snapshot_lock: Optional[asyncio.Lock] = None
        self._partial: Optional[tuple] = None  # (root, bytearray, done parts): a cut-off download of that root
        self.yielded_seconds = 0.0  # serving paused for rounds (averager process), logged per part
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------------------------------- serving

    def _admit(self, joiner: PeerID) -> bool:
        now = time.monotonic()
        self._joiners = {peer: last for peer, last in self._joiners.items() if now - last < JOINER_IDLE}
        if joiner not in self._joiners and len(self._joiners) >= self.serve_max_joiners:
            return False
        self._joiners[joiner] = now
        return True

    def _answer(self, **fields) -> averaging_pb2.DownloadData:
        return averaging_pb2.DownloadData(metadata=self.serializer.dumps(fields))

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not self._admit(context.remote_id):
            logger.info("Busy serving %d joiners: refused the state to %s", len(self._joiners), context.remote_id)
            return
        async for message in super().rpc_download_state(request, context):
            self._joiners[context.remote_id] = time.monotonic()
            yield message

    async def rpc_download_state_part(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        try:
            ask = self.serializer.loads(request.metadata)
            assert isinstance(ask, dict)
        except Exception:
            return
        joiner = context.remote_id
        if ask.get("bye"):
            self._joiners.pop(joiner, None)
            return
        if not self.allow_state_sharing:
            yield self._answer(status="none")
            return
        if not self._admit(joiner):
            logger.info("Busy serving %d joiners: refused a part to %s", len(self._joiners), joiner)
            yield self._answer(status="busy")
            return
        part = ask.get("part")
        if part is None:
            try:
                snapshot = await self._serving_snapshot()
            except StateWithheld as e:
                logger.info("Not serving the state to %s now: %s", joiner, e)
                self._joiners.pop(joiner, None)
                yield self._answer(status="withheld")
                return
            yield self._answer(status="ok", manifest=snapshot.manifest.to_dict(), metadata=snapshot.metadata_bytes)
            return
        snapshot = self._snapshots.get(ask.get("root"))
        if snapshot is None or not isinstance(part, int) or not 0 <= part < len(snapshot.manifest.parts):
            yield self._answer(status="gone")
            return
        yield self._answer(status="ok")
        start, end = snapshot.manifest.ranges()[part]
        data = self._part_bytes(snapshot, part, start, end)
        for offset in range(0, len(data), SERVE_CHUNK):
            await self._yield_to_round()
            await self._pace(min(SERVE_CHUNK, len(data) - offset))
            snapshot.used = self._joiners[joiner] = time.monotonic()
            yield averaging_pb2.DownloadData(
                tensor_part=runtime_pb2.Tensor(buffer=data[offset : offset + SERVE_CHUNK], dtype="uint8")
            )

    def _part_bytes(self, snapshot: _Snapshot, part: int, start: int, end: int) -> bytes:
        """The bytes of ``part`` as served (a rogue donor in the tests overrides this)."""
        return snapshot.buffer[start:end].numpy().tobytes()

    async def _pace(self, nbytes: int) -> None:
        """Called before each chunk is sent (a test donor overrides it to send slowly)."""

    async def _yield_to_round(self) -> None:
        waited = 0.0
        while self.round_running.is_set() and waited < MAX_YIELD_PER_CHUNK:
            await asyncio.sleep(0.05)
            waited += 0.05
        self.yielded_seconds += waited

    async def _serving_snapshot(self) -> _Snapshot:
        if self._snapshot_lock is None:
            self._snapshot_lock = asyncio.Lock()
        async with self._snapshot_lock:
            now = time.monotonic()
            for root in [r for r, s in self._snapshots.items() if now - s.used > SNAPSHOT_KEEP]:
                del self._snapshots[root]
            newest = max(self._snapshots.values(), key=lambda s: s.taken, default=None)
            if newest is not None and now - newest.taken < SNAPSHOT_REUSE:
                newest.used = now
                return newest
            metadata, tensors, _ = await self._get_current_state_from_host_process()
            metadata = self.serializer.loads(metadata)  # hivemind serializes it in the host process
            served = dict(epoch=metadata["epoch"], optimizer_metadata=metadata["optimizer_metadata"])
            metadata_bytes = self.serializer.dumps(served)
            loop = asyncio.get_event_loop()
            buffer = await loop.run_in_executor(None, flatten, tensors)
            manifest = await loop.run_in_executor(
                None,
                Manifest.build,
                served["epoch"],
                metadata_bytes,
                buffer,
                self.serve_part_bytes or part_bytes_for(buffer.numel()),
            )
            snapshot = self._snapshots.get(manifest.root) or _Snapshot(manifest, metadata_bytes, buffer)
            self._snapshots[manifest.root] = snapshot
            while len(self._snapshots) > MAX_SNAPSHOTS:
                del self._snapshots[min(self._snapshots, key=lambda r: self._snapshots[r].used)]
            snapshot.taken = snapshot.used = now
            return snapshot

    # ------------------------------------------------------------------------------------------ download

    async def _ask(self, peer: PeerID, fields: dict, first_timeout: float):
        """The answer header and the iterator of the rest of a part-RPC stream."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        request = averaging_pb2.DownloadData(metadata=self.serializer.dumps(fields))
        stream = await asyncio.wait_for(stub.rpc_download_state_part(request), timeout=first_timeout)
        iterator = stream.__aiter__()
        try:
            head = await asyncio.wait_for(iterator.__anext__(), timeout=first_timeout)
        except StopAsyncIteration:
            raise PartRefused("it answered nothing (it does not share its state now)") from None
        answer = self.serializer.loads(head.metadata)
        if not isinstance(answer, dict) or answer.get("status") != "ok":
            await close_stream(iterator)
            status = answer.get("status") if isinstance(answer, dict) else answer
            raise PartRefused(f"it answered {status!r}")
        return answer, iterator

    async def _say_bye(self, peers) -> None:
        for peer in peers:
            try:
                stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                stream = await asyncio.wait_for(
                    stub.rpc_download_state_part(
                        averaging_pb2.DownloadData(metadata=self.serializer.dumps({"bye": 1}))
                    ),
                    timeout=2.0,
                )
                await close_stream(stream.__aiter__())
            except Exception:
                pass

    async def _fetch_manifest(self, peer: PeerID, expected: int, first_timeout: float):
        answer, iterator = await self._ask(peer, {"part": None}, first_timeout)
        await close_stream(iterator)
        manifest = Manifest.from_dict(answer.get("manifest"), expected)
        metadata_bytes = answer.get("metadata")
        if not isinstance(metadata_bytes, bytes) or digest(metadata_bytes) != manifest.metadata_digest:
            raise ValueError("its metadata does not match its manifest")
        metadata = self.serializer.loads(metadata_bytes)
        if not isinstance(metadata, dict) or metadata.get("epoch") != manifest.epoch:
            raise ValueError("its metadata names another epoch than its manifest")
        return manifest, metadata

    async def _fetch_part(self, peer: PeerID, manifest: Manifest, part: int, first_timeout: float) -> bytes:
        start, end = manifest.ranges()[part]
        size = end - start
        _, iterator = await self._ask(peer, {"part": part, "root": manifest.root}, first_timeout)
        chunks, received = [], 0
        try:
            while True:
                try:
                    message = await asyncio.wait_for(iterator.__anext__(), timeout=self._chunk_timeout())
                except StopAsyncIteration:
                    break
                received += len(message.tensor_part.buffer)
                if received > size:
                    raise ValueError(f"it sent more than part {part}'s {size} bytes")
                chunks.append(message.tensor_part.buffer)
        finally:
            await close_stream(iterator)
        if received != size:
            raise ValueError(f"part {part} arrived with {received} of its {size} bytes (a cut connection)")
        return b"".join(chunks)

    async def _fetch_manifests(self, peers: List[PeerID], expected: int, first_timeout: float, excluded: Set[PeerID]):
        """The manifests and metadata of the ``peers`` whose state may be downloaded now, and how many answered
        ``busy`` or a moment behind (worth asking again); a peer whose state must not be used joins ``excluded``."""
        results = await asyncio.gather(
            *(asyncio.wait_for(self._fetch_manifest(p, expected, first_timeout), first_timeout) for p in peers),
            return_exceptions=True,
        )
        manifests, metadatas, busy = {}, {}, 0
        for peer, result in zip(peers, results):
            if isinstance(result, PartRefused):
                busy += 1
                logger.info("Donor %s did not serve its state now: %s", peer, result)
                continue
            if isinstance(result, BaseException):
                logger.warning("Could not download the state from %s (its manifest): %r", peer, result)
                continue
            manifest, metadata = result
            reason = self.check_downloaded_metadata(metadata)
            if reason is not None and self._behind(metadata):
                busy += 1  # not excluded: the retry after a pause asks it again, it may have caught up by then
                logger.info("Not using the state from %s now: %s", peer, reason)
                continue
            if reason is not None:
                logger.warning("Not applying the state from %s: %s", peer, reason)
                excluded.add(peer)
                continue
            manifests[peer], metadatas[peer] = manifest, metadata
        return manifests, metadatas, busy

    async def _await_lagging_donors(
        self, manifests, metadatas, expected: int, first_timeout: float, excluded: Set[PeerID], deadline: float
    ):
        """Donors one epoch behind the newest manifest are asked again every ``LAGGING_ASK_EVERY`` s, for at most
        ``LAGGING_DONOR_WAIT`` s, while fewer than ``max_donors`` donors hold the newest epoch (``manifests`` and
        ``metadatas`` are updated in place). Trainers end an epoch a moment apart: a joiner that asks while the
        round ends finds some donors at the new epoch and some still at the old one, and only donors of one state
        share a download. Donors further behind are not waited for: they are not ending this round. A
        donor announcing a later epoch than the others (a rogue's claim) costs the joiner this wait at most: the
        others do not reach it, and the largest group of one state is taken as before."""
        wanted = self.download_settings.max_donors
        waited = 0.0
        while waited + LAGGING_ASK_EVERY <= LAGGING_DONOR_WAIT and time.monotonic() + LAGGING_ASK_EVERY < deadline:
            newest = max(manifest.epoch for manifest in manifests.values())
            lagging = [peer for peer, manifest in manifests.items() if manifest.epoch == newest - 1]
            if not lagging or sum(manifest.epoch == newest for manifest in manifests.values()) >= wanted:
                return
            await asyncio.sleep(LAGGING_ASK_EVERY)
            waited += LAGGING_ASK_EVERY
            again, again_metadata, _ = await self._fetch_manifests(lagging, expected, first_timeout, excluded)
            for peer in lagging:
                if peer in excluded:
                    manifests.pop(peer, None)
                    metadatas.pop(peer, None)
                elif peer in again:  # one that did not answer now keeps the manifest it gave a moment ago
                    manifests[peer], metadatas[peer] = again[peer], again_metadata[peer]
            caught_up = [peer for peer in lagging if peer in again and again[peer].epoch == newest]
            if caught_up:
                logger.info("%d donor(s) reached epoch %d after %.1f s: %s", len(caught_up), newest, waited,
                            ", ".join(map(str, caught_up)))  # fmt: skip

    async def _download_in_parts(self, candidates: List[PeerID], excluded: Set[PeerID], deadline: float):
        """The state from up to ``max_donors`` donors of one root at once (module docstring); None if this request's
        try failed (``excluded`` gains the donors that lied: a wrong part or state; one whose part failed may be asked
        again by the next try, which resumes); NoPartDonors if none offers parts."""
        settings = self.download_settings
        layout, _ = self._layout()
        expected = self.state_bytes()
        first_timeout = settings.first_chunk_timeout
        asked = [peer for peer in candidates if peer not in excluded][: settings.max_donors + SPARE_MANIFESTS]
        if not asked:
            return None
        began = time.monotonic()
        manifests, metadatas, busy = await self._fetch_manifests(asked, expected, first_timeout, excluded)
        if not manifests:
            if busy:
                return None
            raise NoPartDonors()
        await self._await_lagging_donors(manifests, metadatas, expected, first_timeout, excluded, deadline)
        groups = group_by_root(manifests)
        group = groups[0]
        for other in groups[1:]:
            for peer in other:
                if len(other) < len(group):  # a minority: a rogue, or an honest peer whose state drifted
                    logger.warning(
                        "Not using the state from %s: its digest (epoch %d) differs from that of %d other donor(s) "
                        "(epoch %d); it is outvoted",
                        peer,
                        manifests[peer].epoch,
                        len(group),
                        manifests[group[0]].epoch,
                    )
                else:  # as many donors hold another state (honest peers' states may differ): the best-ranked wins
                    logger.info(
                        "Not using the state from %s: it differs from the state of as many other donor(s) (epoch %d "
                        "against %d); the state of the best-ranked donor is taken",
                        peer,
                        manifests[peer].epoch,
                        manifests[group[0]].epoch,
                    )
        manifest, metadata = manifests[group[0]], metadatas[group[0]]
        donors, reserve = group[: settings.max_donors], group[settings.max_donors :]
        await self._say_bye([p for p in asked if p not in donors and p not in reserve])

        count = len(manifest.parts)
        if self._partial is not None and self._partial[0] == manifest.root:
            _, buffer, done = self._partial
            logger.info("Resuming the download of epoch %d: %d of %d parts here", manifest.epoch, len(done), count)
        else:
            buffer, done = bytearray(manifest.total_bytes), set()
        schedule = PartSchedule(count=count, max_donors=settings.max_donors, done=set(done))
        ranges = manifest.ranges()
        part_timeout = first_timeout + manifest.part_bytes / MIN_PART_RATE
        received: Dict[PeerID, int] = {}

        async def worker(donor: PeerID) -> bool:
            """Fetches parts until none is left for it; False if the donor failed (out of this try) or lied (out of
            the request: ``excluded``)."""
            while True:
                part = schedule.next_for(donor)
                if part is None:
                    return True
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise TimeoutError("the request ran out of time")
                    data = await asyncio.wait_for(
                        self._fetch_part(donor, manifest, part, first_timeout), timeout=min(part_timeout, remaining)
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    # its parts go to the others now; the next attempt may ask it again and resume (a cut connection
                    # or a slow stretch is no lie; excluding it for the whole request failed every attempt when it was
                    # the only donor)
                    logger.warning(
                        "Could not download part %d of the state from %s: %r; its parts go to the other donors",
                        part,
                        donor,
                        e,
                    )
                    schedule.exclude(donor)
                    return False
                received[donor] = received.get(donor, 0) + len(data)
                if digest(data) != manifest.parts[part]:
                    logger.warning(
                        "Donor %s served part %d of the state whose digest differs from the manifest of %d donor(s) "
                        "(a wrong part): it is excluded and the part is fetched again from another donor",
                        donor,
                        part,
                        len(group),
                    )
                    schedule.exclude(donor)
                    excluded.add(donor)
                    return False
                if schedule.complete(part, donor):
                    start, end = ranges[part]
                    buffer[start:end] = data
                    done.add(part)

        tasks = {asyncio.create_task(worker(donor)) for donor in donors}
        try:
            while tasks and not schedule.finished:
                finished, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    if not task.result() and reserve:
                        tasks.add(asyncio.create_task(worker(reserve.pop(0))))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._say_bye(list(group))
        if not schedule.finished:
            self._partial = (manifest.root, buffer, done)
            logger.warning(
                "Downloaded %d of %d parts of the state of epoch %d; the next request of this epoch resumes with "
                "the %d missing ones",
                len(done),
                count,
                manifest.epoch,
                count - len(done),
            )
            return None
        self._partial = None
        tensors = unflatten(torch.frombuffer(buffer, dtype=torch.uint8), layout)
        reason = self.check_downloaded_state(metadata, tensors)
        if reason is not None:
            for donor in group:
                excluded.add(donor)
            logger.warning("Not applying the state from %s: %s", ", ".join(map(str, group)), reason)
            return None
        per_donor = schedule.donors_per_part()
        logger.info(
            "Downloaded the state (%.1f MB, epoch %d) in %d parts from %d donor(s) in %.1f s: %s",
            expected / 1e6,
            manifest.epoch,
            count,
            len(per_donor),
            time.monotonic() - began,
            ", ".join(f"{peer}: {n} parts, {received.get(peer, 0) / 1e6:.1f} MB" for peer, n in per_donor.items()),
        )
        return metadata, tensors

    def _chunk_timeout(self) -> float:
        return max(PART_CHUNK_TIMEOUT, self.next_chunk_timeout or 0.0)


PART_CHUNK_TIMEOUT = 20.0
"""The longest wait for a part's next chunk (``STATE_CHUNK_TIMEOUT`` of the whole-state download)."""
MIN_PART_RATE = 250_000.0
"""Bytes/s below which a donor's part is given up and moved (``MIN_STATE_RATE`` of the whole-state download)."""


async def close_stream(iterator) -> None:
    """Closes a download stream we stop reading, so the server stops sending (a no-op where it cannot be closed)."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:
            pass
