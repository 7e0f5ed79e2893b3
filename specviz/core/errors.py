"""One error family, so the CLI and the app can show any user mistake as a message."""


class SpecvizError(Exception):
    """Bad input or a model that cannot do what was asked; the message says which."""


class SettingsError(SpecvizError, ValueError):
    """A setting out of its range, an unknown method, an empty prompt."""
