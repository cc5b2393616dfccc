"""Checks a user runs on an install: parity against a vector set, param checks."""
