"""The data tests use the session's Shakespeare preparation from tests/conftest.py."""
