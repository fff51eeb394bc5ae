"""Helpers only the tests use; no tests in here. What tests and benchmarks share is the test-bed package
``benchmarks.testbed`` (peer processes, events, the emulated-link harness, the fault scenarios).

- ``model``: small float64 models and reference comparisons for the model tests.
- ``docker``: a real Docker engine for the opt-in end-to-end test: local base images, the wheelhouse, image
  builds, containers and their cleanup.
"""
