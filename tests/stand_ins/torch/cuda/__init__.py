"""The stand-in's `torch.cuda` (see `torch/__init__.py`)."""
