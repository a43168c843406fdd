"""Errors a user can act on. Entry points print their message and exit non-zero, no traceback."""


class EfftxError(Exception):
    """Base class: something the user can fix (bad config, bad data, cluster too small...)."""


class ConfigError(EfftxError, ValueError):
    pass


class DataError(EfftxError, ValueError):
    pass


class LaunchError(EfftxError, RuntimeError):
    pass


class NonFiniteLossError(EfftxError, FloatingPointError):
    pass


class ExportError(EfftxError, ValueError):
    pass
