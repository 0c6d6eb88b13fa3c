"""Errors a user can fix, kept apart from bugs.

The CLI turns a `UsageError` into one line on stderr and exit code 2; anything
else is a bug and keeps its traceback.
"""


class UsageError(Exception):
    """Bad input from the operator: a config file, a flag, a rule file."""
