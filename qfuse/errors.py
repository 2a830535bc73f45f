"""The error a user can fix: the CLI prints it as one line, `qfuse: error: ...`.

Raise `UserError` for anything the user asked for that cannot be done (a missing
folder, a corrupt shard, a bad flag value, a destination that is the source);
bugs stay ordinary exceptions, so they keep their tracebacks.
"""


class UserError(Exception):
    """A mistake in the user's request; its message alone says what is wrong."""
