"""canzona.CanzonaError: what every failed daemon call raises."""


class CanzonaError(RuntimeError):
    """A failed call: ``code`` is the gRPC status name ("INVALID_ARGUMENT",
    "UNAVAILABLE", ...), the message the daemon's (or the client's, with the
    C++ client's codes and texts)."""

    def __init__(self, message, code="UNKNOWN"):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return (type(self), (str(self), self.code))
