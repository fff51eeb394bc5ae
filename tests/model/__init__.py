"""Tests of model/: the architecture, its memory paths against plain references, generation."""
