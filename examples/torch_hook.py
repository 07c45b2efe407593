"""PyTorch allocating its CUDA tensors from gpupool, through its pluggable-allocator interface.

``gpupool.torch.install()`` must run before PyTorch initializes CUDA (before the first CUDA
tensor, ``torch.cuda.set_device`` or ``current_device``). Then a few training steps of a small
model run as usual, and ``gpupool.torch.memory_stats()`` reads the pool's statistics (PyTorch's
own ``torch.cuda.memory_stats`` raises under a pluggable allocator). Needs PyTorch with CUDA and
a GPU; without them it prints one "skipped" line and exits 0.

    python examples/torch_hook.py
    GPUPOOL_ALLOC_CONF=strategy:pytorch python examples/torch_hook.py   # PyTorch's own rules
"""

import sys

import gpupool
import gpupool.torch  # imports PyTorch only when install() is called

MiB = 1 << 20


def skip(why: str) -> None:
    print(f"skipped: {why}")
    sys.exit(0)


try:
    import torch
except ImportError:
    skip("torch not installed")
if not gpupool.cuda_available():
    skip("no CUDA GPU")
if torch.version.cuda is None:
    skip("this PyTorch is built without CUDA")

gpupool.torch.install()  # reads GPUPOOL_ALLOC_CONF; config="..." sets it here instead
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(5):
    batch = torch.randn(256 + 64 * step, 1024, device="cuda")  # a batch size that changes
    loss = (model(batch) - batch).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss.item():.4f}")

stats = gpupool.torch.memory_stats()
peak_allocated, peak_reserved = stats["allocated_bytes.all.peak"] / MiB, stats["reserved_bytes.all.peak"] / MiB
print(f"gpupool served {stats['allocation.all.allocated']} allocations", end="; ")
print(f"peak allocated {peak_allocated:.1f} MiB, peak reserved {peak_reserved:.1f} MiB")
del model, optimizer, batch, loss
torch.cuda.empty_cache()  # reaches gpupool's pool
reserved = gpupool.torch.memory_stats()["reserved_bytes.all.current"] / MiB
print(f"after torch.cuda.empty_cache(): reserved {reserved:.1f} MiB")
