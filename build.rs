//! Compiles rust/capi_torch.cpp, the C++ thrower behind `gpupool_torch_alloc` (rust/capi.rs).

fn main() {
    println!("cargo:rerun-if-changed=rust/capi_torch.cpp");
    cc::Build::new().cpp(true).file("rust/capi_torch.cpp").warnings(true).compile("gpupool_torch");
}
