"""Exceptions that the CLI turns into one line on stderr (exit code 1; 2 for UsageError), never a traceback."""


class SaemError(Exception):
    """A user-facing error: bad input, missing build, unsupported model."""


class GGUFFormatError(SaemError):
    """The file is not a readable GGUF (missing, truncated, not GGUF, absurd metadata), or holds
    a value llama.cpp would abort on."""


class BuildError(SaemError):
    """The patched llama.cpp could not be fetched, patched or built, or is not built yet."""


class UsageError(SaemError):
    """Flags that cannot go together (found after parsing): a usage error, exit code 2."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: raised in the main thread (like KeyboardInterrupt for SIGINT) so
    that ``finally`` blocks run and no half-written output stays behind. A BaseException, so that
    ``except Exception`` handlers do not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
