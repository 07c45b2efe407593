"""A stand-in for the parts of PyTorch that gpupool.torch.install touches, for tests without torch.

It reproduces the interface, not PyTorch: `torch.cuda.memory.CUDAPluggableAllocator` loads the two
symbols named to it from the library with ctypes, `allocator()` returns an object with the
setters PyTorch's bindings define for its `_CUDAPluggableAllocator` (each takes a function
address), and `change_current_allocator` records the allocator. Tests then call the recorded
functions as PyTorch would. Set `STAND_IN_TORCH_WITHOUT_HOOKS=1` for a PyTorch without setters,
`STAND_IN_TORCH_WITHOUT_FRACTION=1` for one without `set_memory_fraction_fn` only, and
`STAND_IN_TORCH_CUDA_INITIALIZED=1` for one that has initialized CUDA already.
"""
