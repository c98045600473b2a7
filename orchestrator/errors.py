"""Errors the CLI turns into exit codes: bad input exits 2 before Ray starts."""


class BadInput(Exception):
    """A job file, override or name that cannot run: exit 2, nothing started.

    The message says what is wrong, where (file and key path) and what to do.
    """


class DataUnavailable(BadInput):
    """A dataset that cannot be found or downloaded; the message says where to put it."""
