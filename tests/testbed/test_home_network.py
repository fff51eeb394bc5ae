"""Issue 27's home-network scenarios with real peers: volunteers behind NAT'd home routers (10 Mbit/s up, 50 down)
join with the README's command and no NAT flag (benchmarks/testbed/home_swarm.py).

Opt-in: ``python -m pytest -m home_net`` (about 20 minutes on a 2-core machine; needs root, iproute2 and iptables,
which ``bash scripts/setup_env.sh --test`` installs). ``python -m benchmarks.testbed.home_swarm --scenario ...`` runs
the same scenarios and writes the measured table (benchmarks/measured/home_net.json, docs/benchmarks.md). The
testbed's own plumbing (NAT, port forward, line rates) is checked by test_home_plumbing.py in the default run.
"""

from __future__ import annotations

import pytest

from benchmarks.testbed import home_swarm
from benchmarks.testbed.home.network import home_network_unavailable_reason

_REASON = home_network_unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.home_net,
    pytest.mark.netns,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]


def _explain(result: dict) -> str:
    peers = {
        name: {k: p[k] for k in ("reachability", "rounds_ok", "swarm_rounds_after_join", "epochs_done", "notable")}
        for name, p in result["peers"].items()
    }
    failed = [name for name, ok in result["checks"].items() if not ok]
    return f"{result['scenario']}: failed {failed}; peers {peers}; params {result.get('params')}; logs {result['logs']}"


def _run(key: str, folder, duration: float = home_swarm.DURATION, baseline=None) -> dict:
    result = home_swarm.run_scenario(key, folder, duration, baseline=baseline)
    result["logs"] = str(folder)
    return result


@pytest.mark.timeout(480)
def test_a_nat_volunteers_with_the_readme_command_average_with_the_aux(tmp_path):
    result = _run("a", tmp_path)
    volunteers = [p for p in result["peers"].values() if p["role"] == "volunteer"]
    assert len(volunteers) == 2
    for p in volunteers:
        assert p["reachability"] and p["reachability"].startswith("client"), _explain(result)
        assert p["took_part"] is not None and p["took_part"] >= 0.9, _explain(result)
    params = result["params"]
    assert params["max_difference"] is not None and params["max_difference"] <= params["tolerance"], _explain(result)
    assert result["aux"]["bytes_in"] > 0 and result["aux"]["bytes_out"] > 0


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The public trainer and the aux alone: what b's public trainer is compared with."""
    return _run("baseline", tmp_path_factory.mktemp("baseline"))


@pytest.mark.timeout(480)
def test_baseline_public_trainer_alone_goes_through_every_epoch(baseline):
    public = baseline["peers"]["public0"]
    assert public["reachability"] and public["reachability"].startswith("full peer"), _explain(baseline)
    assert public["epochs_fraction"] is not None and public["epochs_fraction"] >= 0.9, _explain(baseline)


@pytest.mark.timeout(480)
def test_b_public_trainer_loses_at_most_ten_percent_of_rounds(tmp_path, baseline):
    result = _run("b", tmp_path, baseline=baseline)
    assert all(result["checks"].values()), _explain(result)
    public = result["peers"]["public0"]
    assert public["epochs_fraction"] >= 0.9 * baseline["peers"]["public0"]["epochs_fraction"], _explain(result)
    for p in result["peers"].values():
        if p["role"] == "volunteer":
            assert p["took_part"] >= 0.9, _explain(result)


@pytest.mark.timeout(480)
def test_c_forwarded_port_and_announce_maddrs_give_a_full_peer(tmp_path):
    result = _run("c", tmp_path)
    forwarded = result["peers"]["volunteer0"]
    assert forwarded["role"] == "forwarded"
    assert forwarded["reachability"] and forwarded["reachability"].startswith("full peer"), _explain(result)
    assert result["dnat_packets"]["volunteer0"] > 0, "nobody dialled the forwarded port: " + _explain(result)
    assert result["peers"]["volunteer1"]["reachability"].startswith("client"), _explain(result)
    assert all(result["checks"].values()), _explain(result)


@pytest.mark.timeout(420)
def test_d_no_reachable_peer_is_said_within_a_minute_and_nothing_is_computed(tmp_path):
    result = _run("d", tmp_path, duration=90.0)
    for name, p in result["peers"].items():
        assert p["message_after_s"] is not None, f"{name} never said 'no reachable peer': " + _explain(result)
        assert p["message_after_s"] <= home_swarm.MESSAGE_BOUND, _explain(result)
        assert p["steps_last_30s"] == 0, f"{name} kept computing gradients nobody can apply: " + _explain(result)
        assert p["rounds_ok"] == 0
