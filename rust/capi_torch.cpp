// The C++ half of gpupool's PyTorch hook: throwing a failed allocation as a C++ exception.
//
// PyTorch's CUDAPluggableAllocator uses the pointer its allocation function returns without
// checking it, so a null would become a tensor at address 0. Its own allocator reports a failed
// allocation by throwing, and every PyTorch frame between the allocator and Python is ready for
// that; gpupool_torch_alloc (rust/capi.rs) does the same through this function. PyTorch turns a
// std::exception into a Python RuntimeError carrying what() (torch.OutOfMemoryError needs
// c10::OutOfMemoryError, a type only code built against PyTorch's headers can throw).

#include <cstring>
#include <new>
#include <stdexcept>

namespace {

// What PyTorch's callers catch as std::bad_alloc, with gpupool's out-of-memory report as what().
class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(const char* message) {
    std::strncpy(message_, message, sizeof message_ - 1);
  }
  const char* what() const noexcept override { return message_; }

 private:
  // A fixed buffer: building a std::string could itself throw while memory is short.
  char message_[4096] = {};
};

}  // namespace

extern "C" [[noreturn]] void gpupool_throw_alloc_error(int out_of_memory, const char* message) {
  if (out_of_memory) {
    throw OutOfMemory(message);
  }
  throw std::runtime_error(message);
}
