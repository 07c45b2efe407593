//! DLPack export: a `dltensor` capsule over an allocation that keeps its `DevicePtr` alive.
//!
//! Consumers that name `max_version` >= 1.0 get a `dltensor_versioned` capsule holding a
//! `DLManagedTensorVersioned` (DLPack 1.x, writable); older ones a `dltensor` capsule holding the
//! unversioned `DLManagedTensor` (which NumPy imports read-only). A consumer renames the capsule
//! (`used_...`) and calls the deleter when done; a capsule never consumed calls it from its own
//! destructor. The deleter drops the reference to the owner, so the memory lives exactly as long
//! as some consumer needs it.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;
use std::ffi::{c_void, CStr};
use std::ptr::NonNull;

/// `kDLCPU` and `kDLCUDA`.
pub const DEVICE_CPU: i32 = 1;
pub const DEVICE_CUDA: i32 = 2;

/// DLPack's type code (`kDLInt` 0, `kDLUInt` 1, `kDLFloat` 2, `kDLBfloat` 4, `kDLComplex` 5,
/// `kDLBool` 6), bits per lane and lanes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

impl DataType {
    pub const BYTE: DataType = DataType { code: 1, bits: 8, lanes: 1 };
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct ManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut ManagedTensor)>,
}

#[repr(C)]
struct ManagedTensorVersioned {
    version: [u32; 2],
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut ManagedTensorVersioned)>,
    /// `DLPACK_FLAG_BITMASK_READ_ONLY` (1) and `..._IS_COPIED` (2): neither applies.
    flags: u64,
    dl_tensor: DlTensor,
}

/// DLPack 1.1, the version of the versioned structs above.
const VERSION: [u32; 2] = [1, 1];
const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";

/// What one export owns; the handed-out struct's `manager_ctx` points back at it.
struct Export {
    legacy: ManagedTensor,
    versioned: ManagedTensorVersioned,
    shape: Vec<i64>,
    /// Never read: the reference itself keeps the exporting `DevicePtr`, and so the memory, alive.
    _owner: Py<PyAny>,
}

/// A C-contiguous tensor of `shape` elements of `dtype` at `data` on `(device_type, device_id)`,
/// in the versioned ABI when `versioned`.
pub fn export<'py>(
    py: Python<'py>,
    owner: Py<PyAny>,
    data: u64,
    device: (i32, i32),
    dtype: DataType,
    shape: Vec<i64>,
    versioned: bool,
) -> PyResult<Bound<'py, PyCapsule>> {
    let tensor = DlTensor {
        data: data as *mut c_void,
        device: DlDevice { device_type: device.0, device_id: device.1 },
        ndim: shape.len() as i32,
        dtype,
        shape: std::ptr::null_mut(),
        // Null strides mean C-contiguous.
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    };
    let export = Box::new(Export {
        legacy: ManagedTensor { dl_tensor: tensor, manager_ctx: std::ptr::null_mut(), deleter: Some(delete_legacy) },
        versioned: ManagedTensorVersioned {
            version: VERSION,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_versioned),
            flags: 0,
            dl_tensor: tensor,
        },
        shape,
        _owner: owner,
    });
    let raw = Box::into_raw(export);
    // SAFETY: `raw` is a live, uniquely owned allocation; nothing else refers to it yet, and a
    // boxed `Vec`'s buffer does not move with the box.
    let (pointer, name, destructor): (*mut c_void, _, ffi::PyCapsule_Destructor) = unsafe {
        let e = &mut *raw;
        let shape = e.shape.as_mut_ptr();
        e.legacy.dl_tensor.shape = shape;
        e.versioned.dl_tensor.shape = shape;
        e.legacy.manager_ctx = raw.cast();
        e.versioned.manager_ctx = raw.cast();
        if versioned {
            (std::ptr::addr_of_mut!(e.versioned).cast(), VERSIONED, drop_versioned_capsule)
        } else {
            (std::ptr::addr_of_mut!(e.legacy).cast(), LEGACY, drop_legacy_capsule)
        }
    };
    let pointer = NonNull::new(pointer).expect("boxed values are never null");
    // SAFETY: the pointer stays valid until the deleter runs, which happens exactly once: from the
    // capsule's destructor if no consumer took it, else from the consumer.
    let capsule = unsafe { PyCapsule::new_with_pointer_and_destructor(py, pointer, name, Some(destructor)) };
    if capsule.is_err() {
        // SAFETY: the capsule was not created, so nothing else refers to `raw`.
        drop(unsafe { Box::from_raw(raw) });
    }
    capsule
}

/// Frees the export at `manager_ctx` and drops its reference to the owner.
///
/// # Safety
/// `manager_ctx` is the pointer `export` leaked, and this runs once for it.
unsafe fn free_export(manager_ctx: *mut c_void) {
    // SAFETY: guaranteed by the caller.
    let export = unsafe { Box::from_raw(manager_ctx.cast::<Export>()) };
    // Consumers may call this from threads of their own; dropping `owner` needs the interpreter.
    // During interpreter shutdown there is none left to free into, so the export is leaked.
    let mut export = Some(export);
    Python::try_attach(|_| drop(export.take()));
    std::mem::forget(export);
}

/// DLPack's deleter of the unversioned struct.
unsafe extern "C" fn delete_legacy(managed: *mut ManagedTensor) {
    // SAFETY: DLPack calls the deleter once, with the struct `export` handed out.
    unsafe { free_export((*managed).manager_ctx) }
}

/// DLPack's deleter of the versioned struct.
unsafe extern "C" fn delete_versioned(managed: *mut ManagedTensorVersioned) {
    // SAFETY: DLPack calls the deleter once, with the struct `export` handed out.
    unsafe { free_export((*managed).manager_ctx) }
}

/// A capsule's destructor: deletes the export unless a consumer renamed the capsule (took it).
///
/// # Safety
/// `capsule` is a live capsule made by `export` under `name`, or renamed by a consumer.
unsafe fn drop_capsule(capsule: *mut ffi::PyObject, name: &CStr) {
    // SAFETY: a live capsule; `PyCapsule_IsValid` sets no exception.
    if unsafe { ffi::PyCapsule_IsValid(capsule, name.as_ptr()) } == 1 {
        // SAFETY: still under its own name, so unconsumed: the deleter has not run.
        let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, name.as_ptr()) };
        // SAFETY: both structs hold `manager_ctx`; read it through the right one.
        let manager_ctx = if name == VERSIONED {
            unsafe { (*managed.cast::<ManagedTensorVersioned>()).manager_ctx }
        } else {
            unsafe { (*managed.cast::<ManagedTensor>()).manager_ctx }
        };
        // SAFETY: unconsumed, so this is the only release.
        unsafe { free_export(manager_ctx) };
    }
}

unsafe extern "C" fn drop_legacy_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: installed only on capsules `export` made under LEGACY.
    unsafe { drop_capsule(capsule, LEGACY) }
}

unsafe extern "C" fn drop_versioned_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: installed only on capsules `export` made under VERSIONED.
    unsafe { drop_capsule(capsule, VERSIONED) }
}
