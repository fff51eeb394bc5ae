"""An emulated home network: public hosts on an "internet" segment and volunteers behind home routers that do source
NAT with no port forwarded (``network.HomeNetwork``), and the scenarios of issue 27 run on it (``benchmarks/testbed/
home_swarm.py``, ``tests/testbed/test_home_network.py``). Needs root, iproute2 and iptables."""
