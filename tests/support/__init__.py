"""Test-only helpers that the test suite and its subprocesses import (never hetconv itself)."""
