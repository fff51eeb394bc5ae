"""--assist_in_averaging with real trainers: the aux peer joins their all-reduce rounds (adding a reducer,
contributing no data), training still converges, and once every trainer is gone (killed mid-round) it
offers its newest verified checkpoint, so a new trainer continues from it.
"""

import pytest

from benchmarks.testbed.aux import RUN_ID, api_state, free_port, peer_report, start_aux, swarm_processes, wait_for
from benchmarks.testbed.trainers import start_trainer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_assisting_aux_joins_averaging_and_restores_an_emptied_swarm(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with swarm_processes() as procs:
        aux = start_aux("aux", tmp_path, port, "--assist_in_averaging", "--verbose", "--alive_window", 8)
        procs.append(aux)
        addrs = aux.initial_peers(timeout=120)
        trainers = [start_trainer(tmp_path, f"trainer{i}", RUN_ID, initial_peers=addrs) for i in (1, 2)]
        procs += trainers
        aux.events.wait("serving", timeout=120)

        # the aux peer takes part in the trainers' gradient all-reduce (in a group with one or both of them:
        # hivemind's matchmaking decides who meets whom)
        aux.wait_for(r"Averaged gradients with [23] peers", timeout=150)
        wait_for(
            lambda: len(api_state(url)["swarm"]["epochs"]) >= 10 and api_state(url)["checkpoint"],
            timeout=180,
            what="ten epochs of metrics and a checkpoint",
        )
        epochs = [e for e in api_state(url)["swarm"]["epochs"] if e["loss"] is not None]
        assert epochs[-1]["loss"] < epochs[0]["loss"] - 0.25, [round(e["loss"], 3) for e in epochs]
        old_peers = {p["peer"] for p in api_state(url)["swarm"]["peers"]}
        last_loss, first_loss = epochs[-1]["loss"], epochs[0]["loss"]

        for trainer in trainers:
            trainer.kill()
        served = int(aux.events.wait("offering_checkpoint", timeout=60)["epoch"])
        newcomer = start_trainer(tmp_path, "trainer3", RUN_ID, initial_peers=addrs)
        procs.append(newcomer)
        _, epoch, loss = wait_for(
            lambda: peer_report(url, old_peers), timeout=120, what="the new trainer's first metrics"
        )
        assert epoch >= served > 0
        assert abs(loss - last_loss) < abs(loss - first_loss)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_client_trainers_train_through_the_aux_by_default_and_pause_without_it(tmp_path):
    """Volunteers nobody can dial (``--reachability private``, what a home NAT gives) and an aux peer with its
    defaults: the aux assists, holds the state of this clients-only swarm, and the clients finish global epochs.
    With an aux that does not assist, a client says within a minute that no reachable peer exists and computes
    nothing."""
    port = free_port()
    with swarm_processes() as procs:
        aux = start_aux("aux", tmp_path, port, "--alive_window", 30)
        procs.append(aux)
        addrs = aux.initial_peers(timeout=120)
        private = ["--reachability", "private"]
        clients = [start_trainer(tmp_path, f"client{i}", RUN_ID, initial_peers=addrs, extra=private) for i in (1, 2)]
        procs += clients
        assert clients[0].events.wait("reachability", timeout=120)["client_mode"] is True
        aux.events.wait("assisting", timeout=180, where=lambda e: e["clients"] > 0)
        aux.events.wait("anchoring", timeout=60, where=lambda e: e["on"])
        for client in clients:
            client.events.wait("epoch_done", timeout=240, where=lambda e: int(e["epoch"]) >= 3)
        losses = [float(e["loss"]) for e in clients[0].events.all("epoch_done") if e.get("loss") is not None]
        assert losses[-1] < losses[0], losses
        assert not clients[0].events.all("reducer_missing")

    lone = tmp_path / "lone"
    lone.mkdir()
    with swarm_processes() as procs:
        aux = start_aux("aux", lone, free_port(), "--assist_in_averaging", "false")
        procs.append(aux)
        addrs = aux.initial_peers(timeout=120)
        client = start_trainer(lone, "client", RUN_ID, initial_peers=addrs, extra=["--reachability", "private"])
        procs.append(client)
        started = client.events.wait("reachability", timeout=120)["time"]
        missing = client.events.wait("reducer_missing", timeout=120)
        assert missing["time"] - started < 60
        client.wait_for(r"no reachable peer in this swarm: .*--announce_maddrs", timeout=30)
        assert not client.events.all("epoch_done")
