//! Turning Python objects into raw memory spans, the engines' way: anything
//! with the buffer protocol (numpy, memoryview, bytearray, mmap), DLPack
//! tensors (`__dlpack__`), `__cuda_array_interface__` objects, raw
//! `(ptr, nbytes)` pairs (as Mooncake and NIXL take them; a third element
//! `"cuda:N"` marks device memory), and for scatter/gather a list of any of
//! these as the segments of one block.
//!
//! Every acquired view is held in a [`Held`] until the call returns, so the
//! exporter cannot free or resize the memory while the GIL is released.

use crate::errors::BufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::ffi::{c_void, CStr};

/// One contiguous run of bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub ptr: usize,
    pub len: usize,
}

/// Where a span lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    Host,
    /// CUDA device memory (`-1`: the current device, as
    /// `__cuda_array_interface__` does not say).
    Cuda(i32),
}

/// The segments of one block, in payload order.
#[derive(Debug, Clone)]
pub(crate) struct BlockSpans {
    pub spans: Vec<Span>,
    pub place: Place,
}

impl BlockSpans {
    pub(crate) fn len(&self) -> usize {
        self.spans.iter().map(|s| s.len).sum()
    }

    /// The block's one host span as a slice (None for a segmented block).
    ///
    /// # Safety
    /// The span must be a live host view of `len` bytes (held by a `Held`
    /// for the whole call) that nothing else writes meanwhile.
    pub(crate) unsafe fn contiguous(&self) -> Option<&[u8]> {
        match self.spans.as_slice() {
            // SAFETY: per this function's contract.
            [s] => Some(unsafe { std::slice::from_raw_parts(s.ptr as *const u8, s.len) }),
            _ => None,
        }
    }

    /// As [`Self::contiguous`], writable.
    ///
    /// # Safety
    /// As for `contiguous`, and the view must be writable and distinct from
    /// every other buffer of the call (the caller's promise, as in C).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn contiguous_mut(&self) -> Option<&mut [u8]> {
        match self.spans.as_slice() {
            // SAFETY: per this function's contract.
            [s] => Some(unsafe { std::slice::from_raw_parts_mut(s.ptr as *mut u8, s.len) }),
            _ => None,
        }
    }

    /// Pairs each segment, in payload order, with its part of `flat` (the
    /// block laid out contiguously, `self.len()` bytes) and runs `f` on
    /// each pair: the one loop behind every gather and scatter (host
    /// memcpy or a CUDA copy).
    pub(crate) fn each_segment<E>(
        &self,
        flat: &mut [u8],
        mut f: impl FnMut(Span, &mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut off = 0;
        for &s in &self.spans {
            f(s, &mut flat[off..off + s.len])?;
            off += s.len;
        }
        Ok(())
    }
}

impl Span {
    /// # Safety
    /// A live host view of `len` bytes, held for the call.
    pub(crate) unsafe fn host(&self) -> &[u8] {
        // SAFETY: per this function's contract.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// # Safety
    /// A live, writable host view of `len` bytes, held for the call, that
    /// nothing else reads or writes meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn host_mut(&self) -> &mut [u8] {
        // SAFETY: per this function's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }
}

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;
const DL_CUDA_MANAGED: i32 = 13;

// DLPack dtype codes (dlpack.h): int, uint, float, bfloat, complex, bool,
// then the float8/float6/float4 family; 3 is an opaque handle (pointers).
const DL_OPAQUE_HANDLE: u8 = 3;
const DL_CODE_MAX: u8 = 17;

/// Whether a DLPack dtype is plain numbers of whole bytes (sub-byte types
/// would make the length computed here wrong; handles are pointers).
fn plain_dl_dtype(code: u8, bits: u8) -> bool {
    code != DL_OPAQUE_HANDLE && code <= DL_CODE_MAX && bits >= 8 && bits.is_multiple_of(8)
}

/// Views and tensors acquired for one call; released on drop (with the GIL
/// held: a `Held` never leaves the attached scope).
#[derive(Default)]
pub(crate) struct Held {
    // Boxed: an exporter may keep the view's address (its `internal`
    // field), so a filled Py_buffer never moves.
    #[allow(clippy::vec_box)]
    views: Vec<Box<ffi::Py_buffer>>,
    tensors: Vec<*mut DlManagedTensor>,
    objs: Vec<Py<PyAny>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        for v in self.views.iter_mut() {
            // SAFETY: each view was filled by a successful
            // PyObject_GetBuffer and is released once, with the GIL held.
            unsafe { ffi::PyBuffer_Release(&mut **v) };
        }
        for t in self.tensors.drain(..) {
            // SAFETY: the consumer of a DLPack capsule owns the managed
            // tensor after renaming the capsule and calls its deleter once.
            unsafe {
                if let Some(d) = (*t).deleter {
                    d(t)
                }
            }
        }
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn raw_pair(obj: &Bound<'_, PyAny>) -> Option<(usize, usize, Option<String>)> {
    let t = obj.cast::<PyTuple>().ok()?;
    if !(2..=3).contains(&t.len()) {
        return None;
    }
    let ptr: usize = t.get_item(0).ok()?.extract().ok()?;
    let len: usize = t.get_item(1).ok()?.extract().ok()?;
    let dev = match t.len() {
        3 => Some(t.get_item(2).ok()?.extract::<String>().ok()?),
        _ => None,
    };
    Some((ptr, len, dev))
}

fn parse_device(s: &str, what: &str) -> PyResult<Place> {
    let s = s.trim().to_ascii_lowercase();
    if s == "cpu" || s == "host" {
        return Ok(Place::Host);
    }
    if s == "cuda" {
        return Ok(Place::Cuda(-1));
    }
    if let Some(n) = s.strip_prefix("cuda:") {
        if let Ok(n) = n.parse::<i32>() {
            return Ok(Place::Cuda(n));
        }
    }
    Err(BufferError::new_err(format!(
        "{what}: device {s:?} is not \"cpu\", \"cuda\" or \"cuda:N\""
    )))
}

/// Acquires one segment.
fn segment(
    obj: &Bound<'_, PyAny>,
    writable: bool,
    held: &mut Held,
    what: &str,
) -> PyResult<(Span, Place)> {
    if let Some((ptr, len, dev)) = raw_pair(obj) {
        if ptr == 0 && len > 0 {
            return Err(BufferError::new_err(format!(
                "{what}: (ptr, nbytes) pair with a null pointer"
            )));
        }
        let place = match dev {
            Some(d) => parse_device(&d, what)?,
            None => Place::Host,
        };
        return Ok((Span { ptr, len }, place));
    }
    if obj.hasattr("__cuda_array_interface__")? {
        return cuda_array_interface(obj, writable, held, what);
    }
    if obj.hasattr("__dlpack_device__")? {
        let (dt, id): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
        let host = dt == DL_CPU || dt == DL_CUDA_HOST;
        // Host objects that also export the buffer protocol (numpy) go
        // that way: it carries the read-only flag, DLPack does not.
        if !(host && supports_buffer(obj)) {
            return dlpack(obj, dt, id, held, what);
        }
    }
    buffer(obj, writable, held, what)
}

fn supports_buffer(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: obj is a live object; the call only inspects its type slots.
    unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) != 0 }
}

fn get_buffer(obj: &Bound<'_, PyAny>, flags: i32) -> Option<Box<ffi::Py_buffer>> {
    // SAFETY: an all-zero Py_buffer is a valid out-parameter.
    let mut v: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
    // SAFETY: obj is live; v is writable; the GIL is held.
    let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *v, flags) };
    if rc != 0 {
        // Drop the pending exception: the caller explains the refusal.
        let _ = PyErr::take(obj.py());
        return None;
    }
    Some(v)
}

#[allow(clippy::boxed_local)]
fn release(mut v: Box<ffi::Py_buffer>) {
    // SAFETY: v came from a successful PyObject_GetBuffer.
    unsafe { ffi::PyBuffer_Release(&mut *v) };
}

/// Whether a buffer-protocol format string (struct module syntax) is one
/// plain number or byte per item: bytes may be written over those freely.
/// Anything else (numpy's object arrays export "O": pointers to Python
/// objects, which onboard would overwrite and the interpreter then
/// follows; structs, pointers, padding) is refused before a byte moves.
fn plain_format(format: &str) -> bool {
    let f = format
        .strip_prefix(['@', '=', '<', '>', '!'])
        .unwrap_or(format);
    let f = f.strip_prefix('Z').unwrap_or(f); // complex: Zf, Zd, Ze
    f.len() == 1 && "bBhHiIlLqQnNefd?c".contains(f)
}

fn buffer_format(v: &ffi::Py_buffer) -> String {
    if v.format.is_null() {
        // The protocol's default: unsigned bytes.
        return "B".into();
    }
    // SAFETY: a non-null format of a filled view is a NUL-terminated string
    // that lives as long as the view.
    unsafe { CStr::from_ptr(v.format) }
        .to_string_lossy()
        .into_owned()
}

fn buffer(
    obj: &Bound<'_, PyAny>,
    writable: bool,
    held: &mut Held,
    what: &str,
) -> PyResult<(Span, Place)> {
    let mut flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT;
    if writable {
        flags |= ffi::PyBUF_WRITABLE;
    }
    if let Some(v) = get_buffer(obj, flags) {
        let format = buffer_format(&v);
        if !plain_format(&format) {
            release(v);
            return Err(BufferError::new_err(format!(
                "{what} ({}) holds items of format {format:?}, not plain numbers: kvtier \
                 moves raw bytes, and an array of Python objects (dtype=object) or of \
                 structs must never be written as bytes; pass a numeric array (e.g. \
                 numpy.uint8)",
                type_name(obj)
            )));
        }
        let span = Span {
            ptr: v.buf as usize,
            len: v.len as usize,
        };
        held.views.push(v);
        return Ok((span, Place::Host));
    }
    let ty = type_name(obj);
    if writable {
        if let Some(v) = get_buffer(obj, ffi::PyBUF_C_CONTIGUOUS) {
            release(v);
            return Err(BufferError::new_err(format!(
                "{what} ({ty}) is read-only; onboard writes into it: pass a writable buffer \
                 (bytearray, numpy array with flags.writeable, memoryview of one)"
            )));
        }
    }
    if let Some(v) = get_buffer(obj, ffi::PyBUF_FULL_RO) {
        release(v);
        return Err(BufferError::new_err(format!(
            "{what} ({ty}) is not C-contiguous: pass numpy.ascontiguousarray(x), or a list \
             of its contiguous segments"
        )));
    }
    Err(BufferError::new_err(format!(
        "{what} ({ty}) is not a buffer: pass an object with the buffer protocol (numpy array, \
         bytearray, memoryview), a DLPack tensor, an object with __cuda_array_interface__, a \
         (ptr, nbytes) pair, or a list of these as segments"
    )))
}

fn contiguous_len(shape: &[i64], strides: Option<&[i64]>, item: i64) -> Option<usize> {
    let mut n: i64 = 1;
    for &d in shape {
        if d < 0 {
            return None;
        }
        n = n.checked_mul(d)?;
    }
    if let Some(st) = strides {
        if n > 0 {
            // Row-major compact: stride[i] == prod(shape[i+1..]) (in elements
            // for DLPack); dims of extent 1 may have any stride.
            let mut expect: i64 = 1;
            for i in (0..shape.len()).rev() {
                if shape[i] != 1 && st[i] != expect {
                    return None;
                }
                expect = expect.checked_mul(shape[i])?;
            }
        }
    }
    usize::try_from(n.checked_mul(item)?).ok()
}

fn dlpack(
    obj: &Bound<'_, PyAny>,
    dev_type: i32,
    dev_id: i32,
    held: &mut Held,
    what: &str,
) -> PyResult<(Span, Place)> {
    let ty = type_name(obj);
    let place = match dev_type {
        DL_CPU | DL_CUDA_HOST => Place::Host,
        DL_CUDA | DL_CUDA_MANAGED => Place::Cuda(dev_id),
        other => {
            return Err(BufferError::new_err(format!(
                "{what} ({ty}) lives on DLPack device type {other}; kvtier takes host memory \
                 (CPU, CUDA host) and CUDA device memory"
            )))
        }
    };
    let cap = obj.call_method0("__dlpack__")?;
    const NAME: &CStr = c"dltensor";
    // SAFETY: cap is live; a wrong name returns null with an exception set.
    let p = unsafe { ffi::PyCapsule_GetPointer(cap.as_ptr(), NAME.as_ptr()) };
    if p.is_null() {
        let _ = PyErr::take(obj.py());
        return Err(BufferError::new_err(format!(
            "{what} ({ty}): __dlpack__() did not return a \"dltensor\" capsule"
        )));
    }
    let mt = p as *mut DlManagedTensor;
    // SAFETY: renaming marks the capsule consumed, so its destructor leaves
    // the tensor to us; we call the deleter in Held::drop.
    unsafe { ffi::PyCapsule_SetName(cap.as_ptr(), c"used_dltensor".as_ptr()) };
    held.tensors.push(mt);
    held.objs.push(cap.unbind());
    // SAFETY: a valid managed tensor per the DLPack contract; shape has ndim
    // entries and strides is null or has ndim entries.
    let (data, shape, strides, item, code, bits) = unsafe {
        let t = &(*mt).dl_tensor;
        let nd = t.ndim.max(0) as usize;
        let shape = std::slice::from_raw_parts(t.shape, nd).to_vec();
        let strides =
            (!t.strides.is_null()).then(|| std::slice::from_raw_parts(t.strides, nd).to_vec());
        let item = (t.dtype.bits as i64 * t.dtype.lanes.max(1) as i64).div_euclid(8);
        (
            (t.data as usize).wrapping_add(t.byte_offset as usize),
            shape,
            strides,
            item,
            t.dtype.code,
            t.dtype.bits,
        )
    };
    if !plain_dl_dtype(code, bits) {
        return Err(BufferError::new_err(format!(
            "{what} ({ty}) has DLPack dtype code {code} of {bits} bits, not a plain number \
             of whole bytes: pass a numeric tensor (e.g. torch.uint8)"
        )));
    }
    let Some(len) = contiguous_len(&shape, strides.as_deref(), item.max(1)) else {
        return Err(BufferError::new_err(format!(
            "{what} ({ty}) is not a contiguous tensor: pass tensor.contiguous(), or a list of \
             its contiguous segments"
        )));
    };
    Ok((Span { ptr: data, len }, place))
}

fn cuda_array_interface(
    obj: &Bound<'_, PyAny>,
    writable: bool,
    held: &mut Held,
    what: &str,
) -> PyResult<(Span, Place)> {
    let ty = type_name(obj);
    let cai = obj.getattr("__cuda_array_interface__")?;
    let d = cai.cast::<PyDict>().map_err(|_| {
        BufferError::new_err(format!(
            "{what} ({ty}): __cuda_array_interface__ is not a dict"
        ))
    })?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        d.get_item(k)?.ok_or_else(|| {
            BufferError::new_err(format!(
                "{what} ({ty}): __cuda_array_interface__ lacks {k:?}"
            ))
        })
    };
    let (ptr, readonly): (usize, bool) = get("data")?.extract()?;
    let shape: Vec<i64> = get("shape")?.extract()?;
    let typestr: String = get("typestr")?.extract()?;
    let item: i64 = typestr.get(2..).and_then(|s| s.parse().ok()).unwrap_or(0);
    // Kinds: bool, int, uint, float, complex; not objects, void or others.
    let kind_ok = typestr.get(1..2).is_some_and(|k| "biufc".contains(k));
    if !kind_ok || item <= 0 {
        return Err(BufferError::new_err(format!(
            "{what} ({ty}) has typestr {typestr:?}, not a plain number: pass a numeric array"
        )));
    }
    let strides: Option<Vec<i64>> = match d.get_item("strides")? {
        Some(s) if !s.is_none() => Some(s.extract()?),
        _ => None,
    };
    if writable && readonly {
        return Err(BufferError::new_err(format!(
            "{what} ({ty}) is read-only; onboard writes into it"
        )));
    }
    // CAI strides are in bytes: convert to elements for the check.
    let el_strides = strides.map(|s| s.iter().map(|x| x / item.max(1)).collect::<Vec<_>>());
    let Some(len) = contiguous_len(&shape, el_strides.as_deref(), item.max(1)) else {
        return Err(BufferError::new_err(format!(
            "{what} ({ty}) is not contiguous: pass a contiguous array or its segments"
        )));
    };
    held.objs.push(obj.clone().unbind());
    Ok((Span { ptr, len }, Place::Cuda(-1)))
}

/// The spans of one block: one buffer-like object, or a list (or a tuple
/// that is not a raw pair) of segments.
pub(crate) fn block_spans(
    obj: &Bound<'_, PyAny>,
    writable: bool,
    held: &mut Held,
    index: usize,
) -> PyResult<BlockSpans> {
    let what = format!("buffer {index}");
    let segs: Option<Vec<Bound<'_, PyAny>>> = if let Ok(l) = obj.cast::<PyList>() {
        Some(l.iter().collect())
    } else if raw_pair(obj).is_none() {
        obj.cast::<PyTuple>().ok().map(|t| t.iter().collect())
    } else {
        None
    };
    match segs {
        None => {
            let (s, place) = segment(obj, writable, held, &what)?;
            Ok(BlockSpans {
                spans: vec![s],
                place,
            })
        }
        Some(items) => {
            if items.is_empty() {
                return Err(BufferError::new_err(format!(
                    "{what} is an empty list of segments"
                )));
            }
            let mut spans = Vec::with_capacity(items.len());
            let mut place = None;
            for (j, it) in items.iter().enumerate() {
                let (s, p) = segment(it, writable, held, &format!("{what} segment {j}"))?;
                if place.is_some_and(|q| q != p) {
                    return Err(BufferError::new_err(format!(
                        "{what}: segments mix host and device memory; one block's segments \
                         must all be in one place"
                    )));
                }
                place = Some(p);
                spans.push(s);
            }
            Ok(BlockSpans {
                spans,
                place: place.unwrap_or(Place::Host),
            })
        }
    }
}

/// All blocks of a call, each checked to be exactly `block_bytes` long.
pub(crate) fn all_blocks(
    bufs: &Bound<'_, PyAny>,
    writable: bool,
    block_bytes: usize,
    count: usize,
    held: &mut Held,
) -> PyResult<Vec<BlockSpans>> {
    let items: Vec<Bound<'_, PyAny>> = bufs
        .try_iter()
        .map_err(|_| {
            BufferError::new_err(format!(
                "buffers must be a list with one buffer per key, got {}",
                type_name(bufs)
            ))
        })?
        .collect::<PyResult<_>>()?;
    if items.len() != count {
        return Err(BufferError::new_err(format!(
            "{} buffers for {count} keys: pass exactly one buffer (or list of segments) per key",
            items.len()
        )));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let b = block_spans(it, writable, held, i)?;
        if b.len() != block_bytes {
            return Err(BufferError::new_err(format!(
                "buffer {i} holds {} bytes; this namespace's blocks are {block_bytes} bytes \
                 (Layout.block_bytes): pass exactly that many, in one buffer or as segments",
                b.len()
            )));
        }
        out.push(b);
    }
    Ok(out)
}
