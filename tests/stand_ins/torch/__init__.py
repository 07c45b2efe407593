"""A stand-in for the parts of PyTorch that gpupool.torch.install touches, for tests without torch.

It reproduces the interface, not PyTorch: `torch.cuda.memory.CUDAPluggableAllocator` loads the two
symbols named to it from the library with ctypes, `allocator()` returns an object with the
setters PyTorch's bindings define for its `_CUDAPluggableAllocator` (each takes a function
address), and `change_current_allocator` records the allocator. Tests then call the recorded
functions as PyTorch would. Set `STAND_IN_TORCH_WITHOUT_HOOKS=1` for a PyTorch without setters.
"""
