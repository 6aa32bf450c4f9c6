"""The one error type of checkpoint loading and saving."""


class CheckpointError(ValueError):
    """A checkpoint is malformed, unsafe, corrupted or does not match the model/optimizer."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no complete checkpoint at the path (also a FileNotFoundError)."""
