"""The stand-in's `torch.cuda` (see `torch/__init__.py`)."""

import os


def is_initialized():
    """Whether CUDA is initialized: set `STAND_IN_TORCH_CUDA_INITIALIZED=1` to say it is."""
    return bool(os.environ.get("STAND_IN_TORCH_CUDA_INITIALIZED"))
