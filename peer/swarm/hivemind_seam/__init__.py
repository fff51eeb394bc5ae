"""The one place where LeanHive reaches into hivemind: every subclass of a hivemind class, every override of a
hivemind method and every use of a private hivemind attribute lives in this small package (``dht``: records,
keys, authorization, routing; ``averaging``: the averagers and the optimizer).

Written against hivemind 1.1.12 (``PINNED_HIVEMIND_VERSION``, the version pyproject.toml pins).
tests/test_hivemind_seam.py fails loudly when the installed version differs or when the signature of a hivemind
method overridden here changed (``OVERRIDDEN_METHODS``); read the hivemind diff for each entry before moving the
pin. The overrides, and why each exists:

DHT records and authorization
- ``RecordSizeValidator(RecordValidatorBase)``: refuses oversized records under any key (schemas only cover the
  keys they know), so a hostile peer cannot fill honest peers' memory.
- ``SwarmKeyValidator(RecordValidatorBase)``: every key the swarm reads takes only per-peer entries of the key's
  form that expire within a bound: hivemind lets a plain value with a later expiration replace a whole dictionary
  (key squatting). Reads ``DHTProtocol.IS_REGULAR_VALUE`` (the serialized "no subkey" marker).
- ``AllowlistAuthorizer(TokenAuthorizerBase)``: hivemind's signed-request protocol with an allowlist of keys
  instead of an authority (``--authorized_keys``).
- ``authorized_peer_ids``: reads the authorizer back from the private ``DHT.kwargs``.
- ``_AllowlistServicer``: averaging RPCs carry no token, so each ``rpc_*`` handler is wrapped with a check of the
  caller's libp2p peer ID; it uses ``ServicerBase._collect_rpc_handlers`` / ``_rpc_handlers`` (private).
- ``private_key_from_der``: builds an ``RSAPrivateKey`` around a key read from disk (sets its private
  ``_private_key``; hivemind only offers a process-wide key or a fresh one).

DHT routing (the watchdog)
- ``routing_table_peers`` / ``ping_peers``: read ``DHTNode.protocol.routing_table`` and ``DHTNode.blacklist`` and
  ping through ``protocol.call_ping``: hivemind 1.1.12 never re-contacts peers after a partition by itself.

Matchmaking (``matchmaking``, both averagers)
- ``LeadersAssemblingBeforeDeadline(PotentialLeaders)``, ``begin_search``: a leader's search ends
  ``LEADER_MARGIN_SECONDS`` before its step's deadline, so a leader that waited its whole window assembles the
  followers it has instead of giving up with them at the deadline (hivemind's two timers fire together there).
  Installed through a ``_matchmaking`` property of ``_PolicyAveraging`` (hivemind assigns the private
  ``DecentralizedAverager._matchmaking`` in the averager process); replaces ``Matchmaking.potential_leaders`` and
  sets ``PotentialLeaders.search_end_time`` (private).
- ``RoundEpochGroupKeys(GroupKeyManager)``, ``current_key`` (local mode only): the group key names the epoch of the
  peer's round (``<prefix>_e<epoch>.0b<bits>``, read from the ``PseudoGradientAverager``'s ``key_epoch``), so peers
  of two rounds never average together; replaces ``Matchmaking.group_key_manager``.

Averaging (both averagers of hivemind.Optimizer)
- ``AveragingPolicy``: what the two averager classes below are configured with (an explicit object); both have
  ``_PolicyAveraging`` as their first base, which applies it (one level, nothing injected below hivemind).
- ``add_p2p_handlers`` (override, ``ServicerBase``): with an allowlist, registers ``_AllowlistServicer``.
- ``_run_allreduce_inplace_`` (override of a private ``DecentralizedAverager`` method): runs
  ``BoundedAllReduceRunner`` (robust aggregation, see peer.swarm.robust), refuses non-finite averaged values and,
  for gradients in a two-contributor round, bounds each update by this peer's own norm (reads the runner's
  ``sender_peer_ids`` and ``weight``).
- ``BoundedPartReducer(TensorPartReducer)`` / ``BoundedAllReduceRunner(AllReduceRunner)``: the reducer keeps every
  sender's part and aggregates with ``bounded_mean`` instead of a running sum (replaces the private
  ``accumulator`` and ``tensor_part_reducer``); a part of the wrong shape is dropped there.
- ``BoundedAllReduceRunner._communicate_with_peer`` (override of a private method): a client-mode peer reads its
  reducer's answer while it sends, so a reducer that refused it (it began after the reducer's sender_timeout) ends
  its round at once; hivemind's client read only after sending everything, its writes failed on the closed stream and
  it waited until its all-reduce timeout. A round in which no reducer averaged anything fails instead of counting as
  averaged (``_run_allreduce_inplace_``); so does, for local mode's pseudo-gradients, a round in which no data of
  another member reached this peer (``heard_from`` reads the reducer's private ``num_parts_received`` and
  ``sender_failed_after``): its result would be its own pseudo-gradient alone, while the others dropped the round.
  A group of this trainer and aux peers only (their declared modes) fails the same way while other trainers train.
  ``_handle_missing_senders`` (override of a private method): a client-mode sender gets twice sender_timeout to
  start (its first part counts, and it crosses a home uplink).
- ``same_result`` (gradient averagers only): every peer of a round takes the same result. hivemind's reducer answers
  each sender with its own compressed delta, so a lossy wire compression left every synchronous trainer with its own
  rounding of the average. ``_generate_input_for_peer`` (override of a private method) marks a sender's first part
  (``SAME_RESULT_MARK`` in the ``peer_id`` field, which hivemind leaves unused there); ``_accumulate_parts_streaming``
  (override of a private method) answers a marked sender with the part's average, encoded once for the group, and
  the reducer takes that encoding as its own result too; unmarked senders (an older peer) still get deltas, and an
  unmarked answer is turned into a result (own part + delta). The container returns results, not deltas
  (``return_deltas``), and ``_run_allreduce_inplace_`` copies them in, counting a round whose whole result it
  took in ``whole_results`` (shared with the host process). The sparse all-gather of local mode copies the group's
  average in the same way (``sparse_wire.take_average``; not at density 1 with 32 bits, which equals dense local
  mode's own + delta bit for bit).
- ``own_part_as_sent`` (the state averager): a reducer averages its own part of a state round as the other reducers
  receive it (encoded, then decoded) and takes the exact delta from that part (``_average_own_shard``, the local
  branch of the private ``_communicate_with_peer``). hivemind averaged its exact part with the others' decoded
  ones, so trainers that held the very same state ended every state round apart by the wire compression's rounding.
- ``schedule_step`` (override, ``GradientAverager`` and ``TrainingStateAverager``): a client-mode peer schedules its
  round at ``client_join_expiration`` (just before its deadline), the expiration it sends leaders; with hivemind's
  ``now + min_matchmaking_time`` a leader that scheduled a moment later (an assisting aux polling for rounds)
  refused it with BAD_EXPIRATION_TIME, and a client has no other leader to join.
- ``__del__`` (override): hivemind's destructors assume a finished constructor; a stop signal while joining leaves a
  half-built object whose ``__del__`` raises AttributeError at exit. That error alone is dropped.

State averager (``LeanHiveStateAverager(TrainingStateAverager)``)
- ``_load_state_from_peers`` (override of a private method, runs in the averager process; replaces hivemind's):
  downloads by ``StateDownloadSettings``, the one retry policy of a state download: at most ``attempts``
  (--load_state_attempts) peer downloads per request, each from the best peer not yet asked (priority capped at the
  epoch bound + 1; only the peers the host names, if it does: the round agreement of ``--sync_mode local``), the
  declarations read again after a pause once every peer was asked. Each download has a time derived from the
  state's size (first chunk within load_state_timeout, then ``STATE_CHUNK_TIMEOUT`` per chunk; hivemind's 3 s
  per-request timeout cut real downloads) and at most the expected size; only a state that passed
  ``check_downloaded_state`` (structure, shapes, dtypes, finiteness, epoch bounds, optimizer hyper-parameters and
  8-bit state sizes) is handed over, so nothing is half applied. Each tensor is deserialized only after its declared
  shape and dtype equal the local layout and its buffer holds exactly that many bytes (``checked_tensor``): a stream
  cut short (a relay circuit's 128 KiB limit) is refused by name, not reshaped. It uses the private
  ``_matchmaking`` (the declarations' key), ``serializer``, ``next_chunk_timeout``; the host sends the epoch bounds
  through the private ``_outer_pipe``.
- ``rpc_download_state_part`` (a new RPC, hivemind's ``DownloadData`` message both ways) and ``_download_in_parts``
  (``state_transfer.py``, mixed in before hivemind's classes): the state from up to ``max_donors`` donors at once,
  part by part, each part checked against the digests its donors announce; a donor serves at most
  ``serve_max_joiners`` joiners (others are told it is busy; hivemind's ``rpc_download_state`` is admitted by the same
  bound) and pauses serving while its own averaging round runs (``round_running``, set by the host around the
  gradient round and here around ``_run_allreduce_inplace_``). The snapshot comes through the private
  ``_get_current_state_from_host_process``.
- ``load_state_from_peers`` / ``_update_scheduler`` (private) / ``step`` / ``get_current_state``: tell whether a
  download was applied (hivemind returns quietly when nobody answers), label the served state with the epoch its
  parameters are really at, snapshot it under ``lock_optimizer`` and refuse to serve NaN/inf, or a state the host
  withholds (``withhold_state``: a local-mode trainer that dropped a round, took a sparse round without a
  groupmate's contribution or lost the round vote, until its round agreement has been followed; joiners are answered
  ``withheld`` and ask again).

Round results (``round_result``: ``RoundResultSharing``, mixed into ``LeanHiveGradientAverager``)
- ``load_accumulators_into_averager_`` (override, ``GradientAverager``): marks the averaged tensors as no longer
  holding a round's result and keeps the norm of this peer's own gradients.
- ``run_in_background`` (override, ``DecentralizedAverager``): allocates the buffer of the previous round's result in
  shared memory before hivemind forks the averager process.
- ``rpc_round_result`` (a new RPC, hivemind's ``DownloadData`` message both ways): a peer that took a ``same_result``
  round's whole result (``_run_allreduce_inplace_`` tells it) serves it until its next round loads its gradients,
  and then as its previous result until the round after.
  The optimizer's ``_average_gradients_and_load_into_optimizer`` (below) fetches it after a failed round
  (``fetch_round_result``, through the private ``_outer_pipe``; the fetch runs in the averager process) from peers
  that declared their state (hivemind's ``<prefix>.all_averagers`` key, ``declared_priorities``), checked (shapes,
  dtypes, finiteness, size; answers agree bit for bit; a norm bound), and steps with it. Uses ``allreduce_kwargs``
  (the wire compression) and ``tensor_infos``. A round is named by its group's ID (``_run_allreduce_inplace_``
  passes it to ``_allreduce_began``) where the asker's group formed, then by its epoch.
  A ``probe`` ask (``round_ended_without_this_peer``) gets only a status: whether the peer holds that round's result.
  The optimizer's ``_wait_for_gradients`` probes while its own round still looks for a group after its epoch ended
  (``_leave_round_taken_without_this_peer``: hivemind's ``StepControl.stage`` and ``deadline``), and a trainer whose
  round the others took without it cancels its matchmaking and fetches the result at once.

Pseudo-gradient averager (``PseudoGradientAverager(LeanHiveGradientAverager)``, ``--sync_mode local``)
- ``load_accumulators_into_averager_``: writes ``shared parameters - local parameters`` (the pseudo-gradient of the
  round) into the averaged tensors instead of the accumulated gradients; built with ``reuse_grad_buffers=True`` so
  hivemind keeps no gradient accumulators (``accumulate_grads_`` then only counts samples). Its prefix is its own
  (``<run_id>_outer_averager``), and it does not bound two-contributor rounds per receiver (that would give the two
  peers different shared parameters). hivemind.Optimizer links its averaged tensors to the outer optimizer's ``.grad``
  (offloaded optimizer), so hivemind's epoch logic runs the outer step unchanged.

Optimizer (``LeanHiveOptimizer(hivemind.Optimizer)``)
- ``_make_state_averager`` (private factory): builds ``LeanHiveStateAverager`` with our policy.
- ``_make_progress_tracker`` (private factory): builds ``LeanHiveProgressTracker``.
- ``_load_local_gradients_into_optimizer`` (private): hivemind's fallback when an all-reduce failed; for a trainer
  it also flags ``missed_round`` so that a sync-mode trainer downloads the swarm's state (peer.strategies), and in
  local mode drops the round (``LeanHiveOptimizer._missed``: ``LeanHiveStateAverager.step`` skips the outer step and
  puts the shared parameters back into the model with the private ``_apply_optimizer_parameters_``).
  ``_begin_averaging_gradients`` (private) flags it too when hivemind began no round because its tracker listed no
  other peer, in the epoch right after a download (the tracker may not list the donors yet); it also tells the
  gradient averager the epoch of the round it begins (``round_epoch``, round_result.py). Where hivemind steps with a
  trainer's own gradients because no other peer reports progress, it cancels the pre-scheduled round itself
  (``cancel_step``: the step marked cancelled before the averager process is told; hivemind's
  ``StepControl.cancel`` does it the other way round, and a round whose group formed at that moment ran with stale
  tensors) and tells the gradient averager that the gradients it loads next are the swarm's step (``own_round``).
  In local mode it and ``_maybe_schedule_gradient_averaging`` (private) set the epoch the round's group key names
  (``_name_round``), and a trainer one epoch behind drops the round at once instead of ending a round the others
  already averaged (``_skip_round_already_over``; hivemind lets it end that round); in local mode a download no
  longer relabels the state one epoch on either.
- ``_average_gradients_and_load_into_optimizer`` (private): hivemind's, timed as the ``grad_wait`` phase, waiting
  ``round_wait.seconds()`` (at least averaging_timeout, longer once rounds proved slower: peer.swarm.round_wait)
  instead of averaging_timeout, and the round's outcome (``timing.round_outcome``) reported to the round observers.
  A trainer whose round failed, or kept some of its own values, takes the round's result from peers that took it
  (``_repair_from_round_result``, round_result.py) before it falls back to hivemind's local gradients (in sync mode
  its accumulators, which the round's start already reset: a step with zero gradients).
  An auxiliary peer takes the epoch's optimizer step, as the trainers do, when its gradient averager took the round's
  whole result (``whole_results``): hivemind 1.1.12 does not pass the peers' modes to the all-reduce runner, so an
  auxiliary averager runs as a zero-weight sender and receives the result like the others, but hivemind's auxiliary
  peers never step. ``step_with_next_epoch`` of the state averager's ``step`` turns the ``optimizer_step=False``
  hivemind passes for them into True (hivemind links the offloaded optimizer's ``.grad`` to the averaged tensors).
  An aux that anchors a swarm of client trainers then serves their state, statistics included, to a joiner or a
  trainer that missed a round.
- ``load_state_from_peers``: hivemind's as one request of the state averager (hivemind retried ``while True``), the
  epoch bound (``download_epoch_bound``) passed to the state averager, a refutation of epoch claims the downloaded
  state does not reach (``LeanHiveProgressTracker.refute_claims_above``), and without the gradient averager's
  download (hivemind downloaded that state and discarded it). Uses the private ``scheduled_grads`` /
  ``_tag_along_with_zero_weight``.
- ``_should_load_state_from_peers`` (private): in sync mode a trainer whose downloaded state is one epoch behind the
  swarm (the others ended that epoch's round during the download) does not download again but takes that round's
  result from them (``_takes_round_of_downloaded_epoch``), and the download does not relabel its state one epoch on.

Phase observers (``timing``)
- ``observe_phases``: the public way to time hivemind's phases (the swarm benchmark's all-reduce and gradient-wait
  timers): the averagers' ``_run_allreduce_inplace_`` (``grad_allreduce`` / ``state_allreduce``) and the
  optimizer's ``_average_gradients_and_load_into_optimizer`` (``grad_wait``) report to it.
- ``observe_rounds``: how each gradient averaging round ended (ok, no group, timeout, failed), for the trainers'
  round health.

Traffic observers (``traffic``)
- ``observe_traffic``: wraps ``P2P.send_raw_data`` / ``P2P.receive_raw_data`` (static methods every hivemind stream
  and RPC writes and reads through) to count the payload bytes of each message, for the trainers' round health.

Reachability (``reachability``; ``USED_METHODS`` there pins the P2P calls)
- ``DialBackServer`` / ``DialBackRequest``: a dial-back probe served on the DHT's own p2pd with
  ``P2P.add_binary_stream_handler`` (run in the DHT process through ``DHT.run_coroutine``; reads ``DHTNode.p2p``):
  the server opens a fresh TCP connection to the requester's announced addresses (its observed IP only, bounded
  per peer and minute) and answers whether a libp2p listener replied. ``own_dialable_maddrs`` drops
  ``/p2p-circuit`` addresses, ``relayed`` tells them apart. ``connect_to`` dials given addresses through the
  private ``P2P._client`` (the relay measurement, benchmarks/relay_limits.py), written by ``go_multiaddr`` in the
  binary form p2pd reads (hivemind's multiaddr library writes ``/p2p/<id>`` as a CID, which p2pd refuses).

Progress tracker (``LeanHiveProgressTracker(ProgressTracker)``)
- ``__init__``: sets its own state (consensus, claims, refutations) before hivemind's, which starts the thread.
- ``_parse_swarm_progress_data`` (private): bounds what one signed record may claim before hivemind's arithmetic
  (a lead over the median of the peers' epochs is followed only until a state download refutes it, a throughput
  cap, ``time`` within the clock skew); writes hivemind's ``global_progress`` again after a refutation; reads the
  private ``_local_public_key`` (its own record) and ``metadata_expiration``/``performance_ema``.
- ``read_consensus_epoch``: the same median consensus read fresh from the DHT (a long download re-reads it; the
  re-sync after an isolation waits on it).
- ``apart_from_swarm``: a trainer more than ``DOWNLOAD_EPOCH_LEAD`` beyond a strict majority of the live trainers'
  votes (it trained apart: no peer of the consensus takes its state) and the peers there, whose state it then takes
  (``LeanHiveOptimizer.load_state_from_peers(rejoin_epoch=...)``; the state averager's scheduler steps back with
  it, writing ``torch``'s ``LambdaLR._step_count``, which hivemind's ``_update_scheduler`` reads). The swarm's
  epoch is this peer's local progress, not its own record in the DHT (stale after such a rejoin).
- ``ready_to_update_epoch`` (property): never for a client-mode peer while no serving trainer reports (nobody
  could join the epochs it ended alone); a client's own samples also count only as much as the others count them.
  An aux peer in sync mode whose epoch is behind the trainers' is ready when their epoch ends (their samples or
  its estimated end, fetched after the aux's last round; reads hivemind's ``fetched_global_progress_this_epoch``),
  not at once: its rounds' label lags theirs by one, and it began each round an epoch early.
- ``report_local_progress``, ``should_report_progress`` (a property over hivemind's event, which it assigns in
  ``__init__``): in local mode (``report_share``) the event that makes hivemind's thread store this peer's signed
  record is held shut until the peer has added a share of the round's target, except near the round's end.
- ``run``: hivemind's thread body, then the cancellation of the helper tasks hivemind leaves pending at shutdown
  (Python printed "Task was destroyed but it is pending!" at exit).
- ``mark_in_sync`` (ours): the joining protocol says when this peer's own epoch starts to vote in the consensus.
- ``load_state_dict``: tells the state averager that its parameters were replaced.
- ``download_epoch_bound``: the highest epoch a downloaded state may carry (the tracker's median consensus +
  a small lead); trainers and the aux replica both use it.
- ``sync_offloaded_parameters``: after parameters change in place, copy them into hivemind's offloaded copies;
  calls the private ``_load_local_tensors_into_averager_`` and ``_update_scheduler``, as hivemind does after a
  download.
"""

from __future__ import annotations

import hivemind
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.averaging.partition import TensorPartReducer
from hivemind.dht.validation import RecordValidatorBase
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P
from hivemind.utils.auth import TokenAuthorizerBase

from peer.swarm.hivemind_seam.averaging import (
    AveragingPolicy,
    BoundedAllReduceRunner,
    BoundedPartReducer,
    LeanHiveGradientAverager,
    LeanHiveOptimizer,
    LeanHiveStateAverager,
    PseudoGradientAverager,
    StateDownloadSettings,
    download_epoch_bound,
    sync_offloaded_parameters,
)
from peer.swarm.hivemind_seam.dht import (
    MAX_CLOCK_SKEW,
    MAX_RECORD_BYTES,
    AllowlistAuthorizer,
    KeyRule,
    RecordSizeValidator,
    SwarmKeyValidator,
    authorized_peer_ids,
    ping_peers,
    private_key_from_der,
    routing_table_peers,
)
from peer.swarm.hivemind_seam.progress import DOWNLOAD_EPOCH_LEAD, LeanHiveProgressTracker, read_consensus_epoch
from peer.swarm.hivemind_seam.state_transfer import StateWithheld
from peer.swarm.hivemind_seam.timing import PHASES, ROUND_EVENTS, observe_phases, observe_rounds
from peer.swarm.hivemind_seam.traffic import observe_traffic

__all__ = [
    "DOWNLOAD_EPOCH_LEAD",
    "MAX_CLOCK_SKEW",
    "MAX_RECORD_BYTES",
    "OVERRIDDEN_METHODS",
    "PHASES",
    "ROUND_EVENTS",
    "PINNED_HIVEMIND_VERSION",
    "PRIVATE_ATTRIBUTES",
    "AllowlistAuthorizer",
    "AveragingPolicy",
    "KeyRule",
    "BoundedAllReduceRunner",
    "BoundedPartReducer",
    "LeanHiveGradientAverager",
    "LeanHiveOptimizer",
    "LeanHiveProgressTracker",
    "LeanHiveStateAverager",
    "PseudoGradientAverager",
    "RecordSizeValidator",
    "StateDownloadSettings",
    "StateWithheld",
    "SwarmKeyValidator",
    "authorized_peer_ids",
    "download_epoch_bound",
    "observe_phases",
    "observe_rounds",
    "observe_traffic",
    "ping_peers",
    "private_key_from_der",
    "read_consensus_epoch",
    "routing_table_peers",
    "sync_offloaded_parameters",
]

PINNED_HIVEMIND_VERSION = "1.1.12"

# (hivemind class, method name, its signature in the pinned version): checked by tests/test_hivemind_seam.py
_DA = hivemind.averaging.DecentralizedAverager
_SCHEDULE_STEP = "(self, scheduled_time: Optional[float] = None, **kwargs) -> hivemind.averaging.control.StepControl"
OVERRIDDEN_METHODS = [
    (P2P, "send_raw_data", "(data: bytes, writer: asyncio.streams.StreamWriter, *, chunk_size: int = 65536) -> None"),
    (P2P, "receive_raw_data", "(reader: asyncio.streams.StreamReader) -> bytes"),
    (RecordValidatorBase, "validate", "(self, record: hivemind.dht.validation.DHTRecord) -> bool"),
    (RecordValidatorBase, "merge_with", "(self, other: 'RecordValidatorBase') -> bool"),
    (RecordValidatorBase, "priority", "property"),
    (TokenAuthorizerBase, "get_token", "(self) -> auth_pb2.AccessToken"),
    (TokenAuthorizerBase, "is_token_valid", "(self, access_token: auth_pb2.AccessToken) -> bool"),
    (TokenAuthorizerBase, "does_token_need_refreshing", "(self, access_token: auth_pb2.AccessToken) -> bool"),
    (
        _DA,
        "add_p2p_handlers",
        "(self, p2p: hivemind.p2p.p2p_daemon.P2P, wrapper: Any = None, *, "
        "namespace: Optional[str] = None, balanced: bool = False) -> None",
    ),
    (
        _DA,
        "_run_allreduce_inplace_",
        "(self, tensors: 'Sequence[torch.Tensor]', group_info: 'GroupInfo', "
        "group_id: 'Optional[bytes]' = None, **kwargs)",
    ),
    (_DA, "_load_state_from_peers", "(self, future: 'MPFuture', timeout: 'Optional[float]' = None)"),
    (_DA, "__del__", "(self)"),
    (TrainingStateAverager, "get_current_state", "(self)"),
    (TrainingStateAverager, "schedule_step", _SCHEDULE_STEP),
    (GradientAverager, "schedule_step", _SCHEDULE_STEP),
    (
        TrainingStateAverager,
        "step",
        "(self, wait_for_delayed_updates: bool = None, apply_delayed_updates: bool = True, increment_epoch: bool = "
        "False, optimizer_step: bool = False, zero_grad: bool = False, delay_optimizer_step: bool = False, "
        "averaging_round: bool = False, delay_averaging: Optional[bool] = None, averaging_control: "
        "Optional[hivemind.averaging.control.StepControl] = None, wait_for_trigger: Optional[Callable[[], Any]] = "
        "None, grad_scaler: Optional[hivemind.optim.grad_scaler.GradScaler] = None, set_to_none: bool = True, "
        "averaging_opts: Optional[Dict[str, Any]] = None)",
    ),
    (
        PotentialLeaders,
        "begin_search",
        "(self, step: 'StepControl', key_manager: 'GroupKeyManager', declare: 'bool' = True)",
    ),
    (TrainingStateAverager, "load_state_from_peers", "(self, **kwargs)"),
    (TrainingStateAverager, "_update_scheduler", "(self)"),
    (TrainingStateAverager, "_load_local_tensors_into_averager_", "(self)"),
    (TrainingStateAverager, "__del__", "(self)"),
    (GradientAverager, "__del__", "(self)"),
    # overridden by PseudoGradientAverager, and by the tests' fault entry point (tests/support/fault_trainer.py)
    (GradientAverager, "load_accumulators_into_averager_", "(self)"),
    (
        _DA,
        "run_in_background",
        "(self, await_ready: 'bool' = True, timeout: 'Optional[float]' = None) -> 'None'",
    ),
    (TensorPartReducer, "reset_accumulators", "(self)"),
    (
        AllReduceRunner,
        "__init__",
        "(self, *, p2p: hivemind.p2p.p2p_daemon.P2P, servicer_type: Type[hivemind.p2p.servicer.ServicerBase], "
        "prefix: Optional[str], group_id: bytes, tensors: Sequence[torch.Tensor], weight: Optional[float] = None, "
        "ordered_peer_ids: Sequence[hivemind.p2p.p2p_daemon_bindings.datastructures.PeerID], peer_fractions: "
        "Tuple[float, ...], modes: Optional[Sequence[hivemind.averaging.allreduce.AveragingMode]] = None, "
        "sender_timeout: Optional[float] = None, reducer_timeout: Optional[float] = None, **kwargs)",
    ),
    (
        AllReduceRunner,
        "_communicate_with_peer",
        "(self, peer_id: hivemind.p2p.p2p_daemon_bindings.datastructures.PeerID)",
    ),
    (AllReduceRunner, "_handle_missing_senders", "(self)"),
    (
        AllReduceRunner,
        "_generate_input_for_peer",
        "(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]",
    ),
    (
        AllReduceRunner,
        "_accumulate_parts_streaming",
        "(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int)",
    ),
    (hivemind.Optimizer, "_make_state_averager", "(self, **kwargs) -> 'TrainingStateAverager'"),
    (hivemind.Optimizer, "_make_progress_tracker", "(self, target_batch_size: 'int', **kwargs) -> 'ProgressTracker'"),
    (
        ProgressTracker,
        "__init__",
        "(self, dht: hivemind.dht.dht.DHT, prefix: str, target_batch_size: int, *, client_mode: Optional[bool] = "
        "None, min_refresh_period: float = 0.5, max_refresh_period: float = 10, default_refresh_period: float = 3, "
        "expected_drift_peers: float = 3, expected_drift_rate: float = 0.2, performance_ema_alpha: float = 0.1, "
        "metadata_expiration: float = 60.0, status_loglevel: int = 10, private_key: "
        "Optional[hivemind.utils.crypto.RSAPrivateKey] = None, daemon: bool = True, start: bool)",
    ),
    (ProgressTracker, "run", "(self)"),
    (
        ProgressTracker,
        "report_local_progress",
        "(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True)",
    ),
    (ProgressTracker, "ready_to_update_epoch", "property"),
    (
        ProgressTracker,
        "_parse_swarm_progress_data",
        "(self, metadata: hivemind.optim.progress_tracker.TrainingProgressSchema) -> "
        "hivemind.optim.progress_tracker.GlobalTrainingProgress",
    ),
    (hivemind.Optimizer, "load_state_dict", "(self, state_dict: 'dict')"),
    (hivemind.Optimizer, "_load_local_gradients_into_optimizer", "(self)"),
    (hivemind.Optimizer, "_maybe_schedule_gradient_averaging", "(self) -> 'None'"),
    (GroupKeyManager, "current_key", "property"),
    (
        GroupKeyManager,
        "__init__",
        "(self, dht: hivemind.dht.dht.DHT, prefix: str, initial_group_bits: str, target_group_size: Optional[int])",
    ),
    (
        hivemind.Optimizer,
        "_begin_averaging_gradients",
        "(self, grad_scaler: 'Optional[GradScaler]') -> 'bool'",
    ),
    (hivemind.Optimizer, "load_state_from_peers", "(self, **kwargs)"),
    (hivemind.Optimizer, "_should_load_state_from_peers", "(self) -> 'bool'"),
    (
        hivemind.Optimizer,
        "_average_gradients_and_load_into_optimizer",
        "(self, maybe_step_control: 'Optional[StepControl]')",
    ),
    (hivemind.Optimizer, "__del__", "(self)"),
    # state_transfer.py (several donors at once): the whole-state stream is admitted by the serving bound
    (
        _DA,
        "rpc_download_state",
        "(self, _request: 'averaging_pb2.DownloadRequest', _context: 'P2PContext') -> "
        "'AsyncIterator[averaging_pb2.DownloadData]'",
    ),
]
# private (or internal) hivemind attributes used here: (module, class name, attribute), checked by the same test
PRIVATE_ATTRIBUTES = [
    ("hivemind.averaging.allreduce", "AllReduceRunner", "tensor_part_reducer"),
    ("hivemind.averaging.partition", "TensorPartReducer", "accumulator"),
    ("hivemind.averaging.partition", "TensorPartReducer", "finished"),
    ("hivemind.averaging.partition", "TensorPartReducer", "part_shapes"),
    ("hivemind.averaging.partition", "TensorPartReducer", "num_senders"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "_p2p"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "_running_groups"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "_averaging_alpha"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "_state_updated"),
    ("hivemind.p2p.servicer", "ServicerBase", "_collect_rpc_handlers"),
    ("hivemind.p2p.servicer", "ServicerBase", "_rpc_handlers"),
    ("hivemind.utils.crypto", "RSAPrivateKey", "_private_key"),
    ("hivemind.dht.dht", "DHT", "kwargs"),
    ("hivemind.dht.node", "DHTNode", "protocol"),
    ("hivemind.dht.node", "DHTNode", "blacklist"),
    ("hivemind.dht.protocol", "DHTProtocol", "routing_table"),
    ("hivemind.dht.protocol", "DHTProtocol", "call_ping"),
    ("hivemind.dht.routing", "RoutingTable", "uid_to_peer_id"),
    ("hivemind.optim.state_averager", "TrainingStateAverager", "main_parameters"),
    ("hivemind.optim.progress_tracker", "ProgressTracker", "_local_public_key"),
    ("hivemind.optim.progress_tracker", "ProgressTracker", "metadata_expiration"),
    ("hivemind.optim.progress_tracker", "ProgressTracker", "performance_ema"),
    # local mode: the event that wakes hivemind's record-storing thread, held shut between shares (progress.py)
    ("hivemind.optim.progress_tracker", "ProgressTracker", "should_report_progress"),
    # an aux behind the trainers' epoch is ready when their epoch ends, on progress fetched after its last round
    ("hivemind.optim.progress_tracker", "ProgressTracker", "fetched_global_progress_this_epoch"),
    # a trainer whose epoch label lagged one behind the round it took catches up (_repair_from_round_result)
    ("hivemind.optim.state_averager", "TrainingStateAverager", "local_epoch"),
    ("hivemind.optim.state_averager", "TrainingStateAverager", "lock_optimizer"),
    ("hivemind.dht.protocol", "DHTProtocol", "IS_REGULAR_VALUE"),
    ("hivemind.optim.state_averager", "TrainingStateAverager", "reuse_tensors"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "_matchmaking"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "_outer_pipe"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "next_chunk_timeout"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "serializer"),
    ("hivemind.optim.state_averager", "TrainingStateAverager", "extra_tensors"),
    # matchmaking.py: our leaders' search ends before the step's deadline
    ("hivemind.averaging.matchmaking", "Matchmaking", "potential_leaders"),
    ("hivemind.averaging.matchmaking", "PotentialLeaders", "search_end_time"),
    ("hivemind.averaging.matchmaking", "PotentialLeaders", "peer_id"),
    ("hivemind.averaging.matchmaking", "PotentialLeaders", "min_matchmaking_time"),
    ("hivemind.averaging.matchmaking", "PotentialLeaders", "target_group_size"),
    # matchmaking.py: local mode's group keys name the round's epoch
    ("hivemind.averaging.matchmaking", "Matchmaking", "group_key_manager"),
    # --sync_mode local drops a round its trainer missed: the model goes back to the shared parameters
    ("hivemind.optim.state_averager", "TrainingStateAverager", "_apply_optimizer_parameters_"),
    ("hivemind.optim.optimizer", "Optimizer", "scheduled_grads"),
    ("hivemind.optim.optimizer", "Optimizer", "_tag_along_with_zero_weight"),
    ("hivemind.optim.optimizer", "Optimizer", "use_gradient_averaging"),
    # the gradient wait (peer.swarm.round_wait) re-implements hivemind's _average_gradients_and_load_into_optimizer
    ("hivemind.optim.optimizer", "Optimizer", "_load_averaged_gradients_into_optimizer_"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "sender_peer_ids"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "weight"),
    # patched by the tests' fault entry point (a peer that sends parts of the wrong shape)
    ("hivemind.averaging.allreduce", "AllReduceRunner", "_generate_input_for_peer"),
    # reachability: the dial-back probe runs on the DHT's p2pd; connect_to dials an address through the daemon client
    ("hivemind.dht.node", "DHTNode", "p2p"),
    ("hivemind.p2p.p2p_daemon", "P2P", "_client"),
    # state_transfer.py: the donor's snapshot comes from the host process as hivemind's own download takes it
    ("hivemind.averaging.averager", "DecentralizedAverager", "_get_current_state_from_host_process"),
    # a client reads its reducer's answer while it sends (BoundedAllReduceRunner._communicate_with_peer)
    ("hivemind.averaging.allreduce", "AllReduceRunner", "tensor_part_container"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "should_delay_results"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "_get_peer_stub"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "reducer_timeout"),
    ("hivemind.averaging.partition", "TensorPartContainer", "num_parts_by_peer"),
    ("hivemind.averaging.partition", "TensorPartContainer", "register_processed_part"),
    ("hivemind.averaging.partition", "TensorPartContainer", "register_failed_reducer"),
    ("hivemind.averaging.partition", "TensorPartContainer", "failed_size"),
    ("hivemind.averaging.partition", "TensorPartContainer", "total_size"),
    ("hivemind.averaging.partition", "TensorPartContainer", "finished"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "all_senders_started"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "active_senders"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "banned_senders"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "_ban_sender"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "sender_timeout"),
    # every peer of a gradient round takes the same result (BoundedAllReduceRunner's same_result)
    ("hivemind.averaging.partition", "TensorPartContainer", "return_deltas"),
    ("hivemind.averaging.partition", "TensorPartContainer", "_input_parts_by_peer"),
    ("hivemind.averaging.partition", "TensorPartContainer", "iterate_input_parts_for"),
    ("hivemind.averaging.partition", "TensorPartContainer", "compression"),
    ("hivemind.averaging.partition", "TensorPartContainer", "prefetch"),
    ("hivemind.averaging.partition", "TensorPartReducer", "accumulate_part"),
    ("hivemind.averaging.partition", "TensorPartReducer", "num_parts"),
    # local mode: a round with no other member's data fails (BoundedAllReduceRunner.heard_from)
    ("hivemind.averaging.partition", "TensorPartReducer", "num_parts_received"),
    ("hivemind.averaging.partition", "TensorPartReducer", "sender_failed_after"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "parts_for_local_averaging"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "tensor_part_reducer"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "ordered_peer_ids"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "sender_peer_ids"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "group_id"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "weight"),
    ("hivemind.averaging.allreduce", "AllReduceRunner", "peer_id"),
    # round_result.py: a missed round's result, served in the wire compression the averager was built with
    ("hivemind.averaging.averager", "DecentralizedAverager", "allreduce_kwargs"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "tensor_infos"),
    ("hivemind.optim.grad_averager", "GradientAverager", "local_times_accumulated"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "_averaged_tensors"),
    ("hivemind.averaging.averager", "DecentralizedAverager", "lock_averaged_tensors"),
    # averaging.py: a late trainer leaves a round the others took without it (_leave_round_taken_without_this_peer)
    ("hivemind.averaging.control", "StepControl", "stage"),
    ("hivemind.averaging.control", "StepControl", "deadline"),
]

# --outer_compression sparse (``sparse_wire``; its docstring says what and why). Its own block, appended: its
# ``_run_allreduce_inplace_`` is pinned above with the other averagers'; it relies on the averager's
# ``rpc_aggregate_part`` handing each stream to the running group's runner.
from peer.swarm.hivemind_seam.sparse_wire import SparseAllGather, SparsePseudoGradientAverager  # noqa: E402

__all__ += ["SparseAllGather", "SparsePseudoGradientAverager"]
OVERRIDDEN_METHODS += [
    (
        _DA,
        "rpc_aggregate_part",
        "(self, stream: 'AsyncIterator[averaging_pb2.AveragingData]', context: 'P2PContext') -> "
        "'AsyncIterator[averaging_pb2.AveragingData]'",
    ),
]
PRIVATE_ATTRIBUTES += [
    ("hivemind.averaging.averager", "DecentralizedAverager", "next_chunk_timeout"),
]
