"""The `ft` command line."""
