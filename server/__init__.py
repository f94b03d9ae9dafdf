"""Serving node: HTTP API on the speculative engine."""
