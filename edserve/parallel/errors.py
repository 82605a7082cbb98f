"""Errors of the tensor-parallel package."""


class TensorParallelError(ValueError):
    """A model or configuration that cannot be split ``--tensor-parallel-size`` ways, or a
    tensor-parallel rank that failed."""
