"""A leader that waited its whole matchmaking window assembles the followers it has, a moment before its deadline.

hivemind 1.1.12 caps a waiting leader's declared expiration at its step's deadline (``PotentialLeaders``'s
``search_end_time``), and ``Matchmaking.look_for_group`` gives up at that same deadline: the two timers fire
together, and the leader that should assemble its group at its expiration almost always gives up first, sends its
followers away ("leader disbanded group") and fails with "could not find a group". A follower that joins in the
last second of a leader's window is therefore always lost. Two peers whose rounds begin a little apart (one ended
its last round later, or joined later) keep that offset: each failed attempt lasts exactly the window, so every
later attempt of one ends just as the other's begins, and the pair missed every round of a run (local mode, the
``tiny`` preset: "could not find a group" on both peers for 12 of 12 rounds, each joining the other's group in its
last 0.4 s). Ending the search ``LEADER_MARGIN_SECONDS`` before the deadline lets the leader assemble them first.

In ``--sync_mode local`` the group key also names the round's epoch (``RoundEpochGroupKeys``): a pseudo-gradient is
the change from its round's shared parameters, so it is averaged only with those of the same round. hivemind's key
names no round, and a peer one epoch behind (it ended its last round later, or downloaded the state while the
others ended one) met the others' next round: both applied the same average to different rounds, and their shared
parameters stayed apart until a later vote (the local pair test beside a busy loop: 3 of 7 runs, and the
landing CI of 39f204a).

Installed on each of our averagers' ``Matchmaking`` when hivemind creates it in the averager process
(``_PolicyAveraging._matchmaking``, averaging.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders

LEADER_MARGIN_SECONDS = 0.25
"""How long before its deadline a leader assembles the followers it has: longer than the averager process's event
loop takes to run the assembly on a busy machine, and short, because after the search ends a leader without
followers re-declares until its deadline (hivemind's loop, which declares an already expired time)."""


class LeadersAssemblingBeforeDeadline(PotentialLeaders):
    """``PotentialLeaders`` whose search (and so the last declared expiration) ends ``LEADER_MARGIN_SECONDS`` before
    the step's deadline, while ``look_for_group`` still waits until the deadline itself."""

    @contextlib.asynccontextmanager
    async def begin_search(self, step, key_manager, declare: bool = True):
        async with super().begin_search(step, key_manager, declare=declare) as leaders:
            # hivemind created its declare and queue tasks just before yielding; they have not run yet, so their
            # first declaration already uses this end
            if step.deadline is not None:
                self.search_end_time = step.deadline - LEADER_MARGIN_SECONDS
            yield leaders


class RoundEpochGroupKeys(GroupKeyManager):
    """hivemind's group keys with the epoch of this peer's round in them: ``<prefix>_e<epoch>.0b<bits>``, read
    from ``round_epoch`` (a ``multiprocessing.Value`` the host process sets before each round, see
    ``LeanHiveOptimizer._name_round``) at every declaration, lookup and join request, so a leader refuses a
    follower of another round (hivemind's "bad group key")."""

    def __init__(self, keys: GroupKeyManager, round_epoch: Any):
        super().__init__(keys.dht, keys.prefix, keys.group_bits, keys.target_group_size)
        self.round_epoch = round_epoch

    @property
    def current_key(self) -> str:
        return f"{self.prefix}_e{int(self.round_epoch.value)}.0b{self.group_bits}"


def install(matchmaking: Matchmaking, round_epoch: Optional[Any] = None) -> Matchmaking:
    """Give hivemind's freshly built ``matchmaking`` our ``PotentialLeaders`` (before its first search) and, given
    ``round_epoch``, group keys that name the round's epoch."""
    leaders = matchmaking.potential_leaders
    matchmaking.potential_leaders = LeadersAssemblingBeforeDeadline(
        leaders.peer_id, leaders.min_matchmaking_time, leaders.target_group_size
    )
    if round_epoch is not None:
        matchmaking.group_key_manager = RoundEpochGroupKeys(matchmaking.group_key_manager, round_epoch)
    return matchmaking
