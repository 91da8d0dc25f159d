"""Helpers for the tests that run real agent harnesses (Codex, ...) against a demo server."""
