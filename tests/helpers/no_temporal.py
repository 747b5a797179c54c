"""A stand-in for the Temporal client in API tests that must fail before Temporal is reached."""

from __future__ import annotations


class NoTemporal:
    """Stands in for the Temporal client: any use of it is a test failure."""

    def __getattr__(self, name):
        raise AssertionError(f"validation must fail before Temporal is used (called {name})")
