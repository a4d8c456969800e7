//! The only CUDA `unsafe` in kvtier: the GPU's primary context, pinned host
//! buffers, device buffers, streams, and cuFile handles, all through
//! cudarc's dynamically loaded driver API. Callers reach this module only
//! after [`crate::Capabilities::probe`] found a driver, so cudarc never gets
//! the chance to panic on a missing library.

use crate::error::{Error, Result};
use crate::memory::DeviceSpan;
use cudarc::driver::{result as cu, sys};
use std::sync::Arc;

fn cuda_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        detail: e.to_string(),
    }
}

/// One GPU: its device handle and retained primary context (the context
/// engines such as PyTorch use, so their pointers are valid here).
#[derive(Debug)]
pub struct Gpu {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    ordinal: u32,
}

// SAFETY: CUdevice is an integer and a primary context may be made current
// on any thread; every use goes through `bind`.
unsafe impl Send for Gpu {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Opens device `ordinal` (retains its primary context).
    pub fn open(ordinal: u32) -> Result<Arc<Self>> {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoCuda {
                reason: "CUDA driver library (libcuda) not found".into(),
            });
        }
        cu::init().map_err(cuda_err("cuInit"))?;
        let dev = cu::device::get(ordinal as i32).map_err(cuda_err("cuDeviceGet"))?;
        // SAFETY: `dev` came from cuDeviceGet.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }
            .map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        let gpu = Gpu { dev, ctx, ordinal };
        gpu.bind()?;
        Ok(Arc::new(gpu))
    }

    /// Makes the primary context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: ctx is a retained primary context, alive while self is.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(cuda_err("cuCtxSetCurrent"))
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Device name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> String {
        cu::device::get_name(self.dev).unwrap_or_default()
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: retained in `open`; released once here.
        let _ = unsafe { cu::primary_ctx::release(self.dev) };
    }
}

/// Page-locked host memory (cuMemHostAlloc): DMA-able, so host-to-device
/// copies from it run asynchronously at full PCIe speed.
#[derive(Debug)]
pub struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
    gpu: Arc<Gpu>,
}

// SAFETY: uniquely owned memory.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    /// `len` zeroed pinned bytes (page-aligned by the driver).
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<Self> {
        gpu.bind()?;
        // SAFETY: plain allocation; zeroed below before any read.
        let p = unsafe { cu::malloc_host(len.max(1), 0) }.map_err(cuda_err("cuMemHostAlloc"))?;
        let mut b = PinnedBuf {
            ptr: p as *mut u8,
            len,
            gpu: gpu.clone(),
        };
        b.as_mut_slice().fill(0);
        Ok(b)
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: valid for len bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, unique through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
            let _ = unsafe { cu::free_host(self.ptr as *mut std::ffi::c_void) };
        }
    }
}

/// Device memory (cuMemAlloc) owned by this crate: test and benchmark
/// destinations, or memory a caller wants managed here.
#[derive(Debug)]
pub struct DeviceBuf {
    ptr: sys::CUdeviceptr,
    len: usize,
    gpu: Arc<Gpu>,
}

// SAFETY: a device address owned uniquely.
unsafe impl Send for DeviceBuf {}

impl DeviceBuf {
    /// `len` bytes of device memory, zeroed.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<Self> {
        gpu.bind()?;
        // SAFETY: plain allocation in the bound context.
        let ptr = unsafe { cu::malloc_sync(len.max(1)) }.map_err(cuda_err("cuMemAlloc"))?;
        let b = DeviceBuf {
            ptr,
            len,
            gpu: gpu.clone(),
        };
        b.fill(0)?;
        Ok(b)
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device span (pointer and length).
    pub fn span(&self) -> DeviceSpan {
        DeviceSpan {
            ptr: self.ptr,
            len: self.len,
        }
    }
    /// A sub-span (for layer regions carved out of one allocation, with
    /// guard bytes between them).
    pub fn sub_span(&self, off: usize, len: usize) -> Result<DeviceSpan> {
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(Error::Layout {
                what: "device sub-span",
                detail: format!("{off}+{len} exceeds {} bytes", self.len),
            });
        }
        Ok(DeviceSpan {
            ptr: self.ptr + off as u64,
            len,
        })
    }
    /// Sets every byte to `v` (synchronous).
    pub fn fill(&self, v: u8) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: ptr is valid for len bytes.
        unsafe { cu::memset_d8_sync(self.ptr, v, self.len) }.map_err(cuda_err("cuMemsetD8"))
    }
    /// Copies `src` to offset `off` (synchronous).
    pub fn write(&mut self, off: usize, src: &[u8]) -> Result<()> {
        let span = self.sub_span(off, src.len())?;
        self.gpu.bind()?;
        // SAFETY: span checked against the allocation.
        unsafe { cu::memcpy_htod_sync(span.ptr, src) }.map_err(cuda_err("cuMemcpyHtoD"))
    }
    /// Copies `dst.len()` bytes from offset `off` to the host (synchronous).
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        let span = self.sub_span(off, dst.len())?;
        self.gpu.bind()?;
        copy_dtoh(span.ptr, dst)
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated in `new`, freed once.
            let _ = unsafe { cu::free_sync(self.ptr) };
        }
    }
}

/// Synchronous device-to-host copy of `dst.len()` bytes at `ptr`.
pub(crate) fn copy_dtoh(ptr: u64, dst: &mut [u8]) -> Result<()> {
    // SAFETY: callers pass a device range valid for dst.len() bytes in the
    // current context (a checked DeviceBuf span, or a span the caller of
    // `Destination::device_raw` vouched for).
    unsafe { cu::memcpy_dtoh_sync(dst, ptr) }.map_err(cuda_err("cuMemcpyDtoH"))
}

/// Synchronous copy of `src` to the device address `dst` on `gpu`, for
/// memory kvtier did not allocate (an engine's tensor).
///
/// # Safety
/// `dst` must be a device range valid for `src.len()` bytes in `gpu`'s
/// primary context for the whole call.
pub unsafe fn copy_htod_raw(gpu: &Gpu, dst: u64, src: &[u8]) -> Result<()> {
    gpu.bind()?;
    // SAFETY: forwarded from the caller's contract.
    unsafe { cu::memcpy_htod_sync(dst, src) }.map_err(cuda_err("cuMemcpyHtoD"))
}

/// Synchronous copy of `dst.len()` bytes from the device address `src` on
/// `gpu` into host memory.
///
/// # Safety
/// `src` must be a device range valid for `dst.len()` bytes in `gpu`'s
/// primary context for the whole call.
pub unsafe fn copy_dtoh_raw(gpu: &Gpu, src: u64, dst: &mut [u8]) -> Result<()> {
    gpu.bind()?;
    copy_dtoh(src, dst)
}

/// A CUDA stream used for the host-to-device hop of one bounce buffer.
#[derive(Debug)]
pub(crate) struct Stream {
    s: sys::CUstream,
}

// SAFETY: streams may be used from any thread with the context bound.
unsafe impl Send for Stream {}

impl Stream {
    pub(crate) fn new() -> Result<Self> {
        let s = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(cuda_err("cuStreamCreate"))?;
        Ok(Stream { s })
    }

    /// Queues a copy of `src` to device address `dst`.
    ///
    /// # Safety
    /// `src` must be pinned memory that stays untouched and alive until
    /// [`Stream::sync`] returns; `dst` must be valid for `src.len()` bytes.
    pub(crate) unsafe fn htod_async(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { cu::memcpy_htod_async(dst, src, self.s) }.map_err(cuda_err("cuMemcpyHtoDAsync"))
    }

    /// Queues a copy of `dst.len()` bytes at device address `src` into `dst`.
    ///
    /// # Safety
    /// `dst` must be pinned memory that nothing reads or writes until
    /// [`Stream::sync`] returns; `src` must be valid for `dst.len()` bytes.
    pub(crate) unsafe fn dtoh_async(&self, dst: &mut [u8], src: u64) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.s) }.map_err(cuda_err("cuMemcpyDtoHAsync"))
    }

    /// Waits for every copy queued on this stream.
    pub(crate) fn sync(&self) -> Result<()> {
        // SAFETY: the stream is alive while self is.
        unsafe { cu::stream::synchronize(self.s) }.map_err(cuda_err("cuStreamSynchronize"))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created in `new`; queued work was synchronised by the
        // transfer before returning.
        let _ = unsafe { cu::stream::destroy(self.s) };
    }
}

/// Measures host-to-device copy bandwidth from pinned memory: `reps`
/// copies of `bytes`, in GB/s (the PCIe baseline of `kvtier bench gds`).
pub fn h2d_pinned_gbps(gpu: &Arc<Gpu>, bytes: usize, reps: usize) -> Result<f64> {
    let src = PinnedBuf::new(gpu, bytes)?;
    let dst = DeviceBuf::new(gpu, bytes)?;
    let stream = Stream::new()?;
    let t = std::time::Instant::now();
    for _ in 0..reps.max(1) {
        // SAFETY: src is pinned and lives past the sync below; dst is valid.
        unsafe { stream.htod_async(dst.ptr, src.as_slice())? };
    }
    stream.sync()?;
    let secs = t.elapsed().as_secs_f64();
    Ok(if secs > 0.0 {
        (bytes * reps.max(1)) as f64 / secs / 1e9
    } else {
        0.0
    })
}

/// A block file registered with cuFile for GPUDirect reads.
pub(crate) struct GdsFile {
    handle: cudarc::cufile::sys::CUfileHandle_t,
}

impl GdsFile {
    /// Registers `file` (which must outlive the handle).
    pub(crate) fn register(file: &std::fs::File) -> Result<Self> {
        use cudarc::cufile::sys as cf;
        use std::os::fd::AsRawFd;
        let descr = cf::CUfileDescr_t {
            type_: cf::CUfileFileHandleType::CU_FILE_HANDLE_TYPE_OPAQUE_FD,
            handle: cf::CUfileDescr_t__bindgen_ty_1 {
                fd: file.as_raw_fd(),
            },
            fs_ops: std::ptr::null(),
        };
        let handle = std::panic::catch_unwind(|| cudarc::cufile::result::handle_register(&descr))
            .map_err(|_| Error::Gds {
                op: "cuFileHandleRegister",
                detail: "panicked".into(),
            })?
            .map_err(|e| Error::Gds {
                op: "cuFileHandleRegister",
                detail: format!("{e:?}"),
            })?;
        Ok(GdsFile { handle })
    }

    /// Reads `len` bytes at `file_off` into device address `dst`, looping
    /// over short reads. Returns bytes read (less than `len` only at EOF).
    ///
    /// # Safety
    /// `dst` must be device memory valid for `len` bytes.
    pub(crate) unsafe fn read(&self, dst: u64, len: usize, file_off: u64) -> Result<usize> {
        let mut done = 0usize;
        while done < len {
            // Called directly rather than through cudarc's wrapper, which
            // transmutes unknown error codes into an enum.
            // SAFETY: dst valid for len bytes (caller); handle registered.
            let n = unsafe {
                cudarc::cufile::sys::cuFileRead(
                    self.handle,
                    dst as *mut std::ffi::c_void,
                    len - done,
                    (file_off + done as u64) as i64,
                    done as i64,
                )
            };
            if n < 0 {
                let detail = if n == -1 {
                    std::io::Error::last_os_error().to_string()
                } else {
                    format!("cuFile error {}", -n)
                };
                return Err(Error::Gds {
                    op: "cuFileRead",
                    detail,
                });
            }
            if n == 0 {
                break;
            }
            done += n as usize;
        }
        Ok(done)
    }
}

impl Drop for GdsFile {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once.
        let _ = unsafe { cudarc::cufile::result::handle_deregister(self.handle) };
    }
}

/// Synchronous host-to-device copy of `src` to `ptr`.
pub(crate) fn copy_htod(ptr: u64, src: &[u8]) -> Result<()> {
    // SAFETY: callers pass a device range valid for src.len() bytes (see
    // `copy_dtoh`).
    unsafe { cu::memcpy_htod_sync(ptr, src) }.map_err(cuda_err("cuMemcpyHtoD"))
}

/// The device span of a cudarc slice the engine owns, after waiting for
/// the work already queued on its stream (so our copies cannot race the
/// engine's). cudarc contexts are primary contexts, the ones [`Gpu`] uses.
pub(crate) fn cudarc_span(s: &mut cudarc::driver::CudaSlice<u8>) -> Result<DeviceSpan> {
    use cudarc::driver::DevicePtrMut;
    let ordinal = s.context().ordinal();
    if ordinal != 0 {
        return Err(Error::NoCuda {
            reason: format!("slice lives on GPU {ordinal}; kvtier-gds transfers into GPU 0"),
        });
    }
    let stream = s.stream().clone();
    stream
        .synchronize()
        .map_err(cuda_err("cuStreamSynchronize"))?;
    let len = s.len();
    let (ptr, _record) = s.device_ptr_mut(&stream);
    Ok(DeviceSpan { ptr, len })
}
