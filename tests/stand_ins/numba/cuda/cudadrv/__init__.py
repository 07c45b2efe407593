"""The stand-in's `numba.cuda.cudadrv`."""
