"""Runs: fingerprints, manifests and pins, submit, replay, status."""
