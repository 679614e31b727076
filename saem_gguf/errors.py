"""Exceptions that the CLI turns into one line on stderr (exit code 1; 2 for UsageError), never a traceback."""


class SaemError(Exception):
    """A user-facing error: bad input, missing build, unsupported model."""


class GGUFFormatError(SaemError):
    """The file is not a readable GGUF (missing, truncated, not GGUF, absurd metadata)."""


class BuildError(SaemError):
    """The patched llama.cpp could not be fetched, patched or built, or is not built yet."""


class UsageError(SaemError):
    """Flags that cannot go together (found after parsing): a usage error, exit code 2."""
