"""Emulated internet links between test hosts (needs root and iproute2; no kernel netem required).

Link model:

- Hosts are network namespaces with one veth each on a bridge in a dedicated "switch" namespace
  (``hosts.Testbed``); addresses come from 10.213.k.0/24 and there is no default route, so test
  traffic never leaves the namespaces.
- Bandwidth: ``Testbed.set_bandwidth(host, mbit)`` puts tbf on the host's veth (upload) and on the
  bridge-side veth (download). Real kernel queues, so TCP sees real back-pressure.
- Delay, jitter, loss and partitions: this kernel has no netem qdisc, so a user-space TCP proxy
  (``proxy``) runs in front of each listening peer. It delays every chunk in both directions (order
  kept), turns "loss" into a retransmission-timeout stall, and on partition resets connections from
  the cut-off source IPs and blackholes new ones. Settings change at run time over a UNIX socket.
- ``Testbed.set_link_up(host, False)`` pulls a host's cable at the switch instead (packets dropped,
  sockets stall rather than reset).

How a scenario test uses it (hivemind peers)::

    from benchmarks.testbed.netem.hosts import Testbed
    from benchmarks.testbed.netem.proxy import ProxySettings

    with Testbed(3) as tb:
        for host in tb.hosts:
            tb.set_bandwidth(host, 100)
        proxies = [tb.start_proxy(host, target_port=40000, settings=ProxySettings(delay_ms=25))
                   for host in tb.hosts]
        # peer i listens on /ip4/<host.ip>/tcp/40000 and announces proxies[i].maddr, so every
        # connection *to* it crosses its proxy: 25 ms each way = 50 ms RTT on every link
        peer = tb.hosts[0].python("-m", "run_trainer", "--host_maddrs", f"/ip4/{tb.hosts[0].ip}/tcp/40000",
                                  "--announce_maddrs", proxies[0].maddr, ...)
        tb.partition(tb.hosts[1])   # every proxy cuts host 1, host 1's own proxy cuts everyone
        tb.heal(tb.hosts[1])

Caveat for hivemind 1.1.12: a DHT node evicts a peer that fails one RPC from its routing table, bans
it from searches for 5 s (doubling per failure) and never re-bootstraps, so after a partition that
failed a request a peer stays isolated until it pings its initial peers again (``dht_agent._rejoin``
shows how: ``node.protocol.call_ping(peer_id)`` and ``node.blacklist.register_success(peer_id)``).
"""
# No re-exports: `python -m benchmarks.testbed.netem.proxy` would otherwise import itself twice (runpy warning).
