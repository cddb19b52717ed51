"""Errors that reach the user as one clear line and a non-zero exit code, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: the message names what was wrong and what is allowed."""

    exit_code = 2


class DataError(UserError):
    """A data source that cannot be read (missing path, unreachable hub, malformed file)."""


NONFINITE_EXIT_CODE = 3  # training stopped on a non-finite loss or gradient; rank 0 has said where
