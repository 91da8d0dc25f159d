"""Model definitions and checkpoint helpers."""
