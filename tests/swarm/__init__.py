"""Tests of peer/swarm/, the layer both peers share: arguments, data, optimizer, averaging, records, seam."""
