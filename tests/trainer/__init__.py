"""Tests of the trainer peer (peer/trainer.py, peer/cli.py, peer/memory_plan.py), in process and as real peers."""
