"""Shared test utilities (peers as subprocesses)."""
