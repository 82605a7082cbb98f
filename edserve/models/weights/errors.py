"""The error every weight reader raises for a checkpoint it cannot use."""


class WeightsError(ValueError):
    """A checkpoint file is missing, corrupt, or in a layout edserve cannot read.

    The message always names the offending file (or folder).
    """
