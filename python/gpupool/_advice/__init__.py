"""``gpupool advise``: what-if answers from a PyTorch memory snapshot (see ``gpupool.advise``)."""
