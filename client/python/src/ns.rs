//! `Layout` and `Namespace`: what a block belongs to, and its key chain.

use crate::errors::{InvalidKeyError, NamespaceError};
use kvtier_client::{BlockKey, Dtype, HashMode, KvLayout, LayoutKind};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyList};

/// The shape of one KV block: bytes = tokens x layers x 2 (K, V) x kv_heads
/// x head_dim x dtype size.
///
/// >>> Layout(layers=32, kv_heads=8, head_dim=128, dtype="bf16", tokens_per_block=16).block_bytes
/// 2097152
#[pyclass(module = "kvtier", frozen, eq, hash, from_py_object)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct Layout {
    pub(crate) inner: KvLayout,
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
        Dtype::F32 => "f32",
        Dtype::Fp8E4m3 => "fp8e4m3",
        Dtype::Fp8E5m2 => "fp8e5m2",
        Dtype::U8 => "u8",
    }
}

#[pymethods]
impl Layout {
    /// Layout(layers, kv_heads, head_dim, dtype="bf16", tokens_per_block=16, layer_separate=False)
    ///
    /// dtype: "f16", "bf16", "f32", "fp8e4m3", "fp8e5m2" or "u8".
    /// layer_separate: the engine keeps each layer's K and V of a block in
    /// its own region (pass each block as a list of per-layer segments);
    /// the stored block is the layers back to back either way.
    #[new]
    #[pyo3(signature = (layers, kv_heads, head_dim, dtype="bf16", tokens_per_block=16, layer_separate=false))]
    fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: &str,
        tokens_per_block: u32,
        layer_separate: bool,
    ) -> PyResult<Self> {
        let dt = Dtype::parse(dtype).ok_or_else(|| {
            NamespaceError::new_err(format!(
                "dtype {dtype:?} is not one of f16, bf16, f32, fp8e4m3, fp8e5m2, u8"
            ))
        })?;
        let l = KvLayout {
            layers,
            kv_heads,
            head_dim,
            dtype: dt,
            tokens_per_block,
            kind: if layer_separate {
                LayoutKind::LayerSeparate
            } else {
                LayoutKind::LayerContiguous
            },
        };
        l.validate().map_err(crate::errors::from_client)?;
        Ok(Layout { inner: l })
    }

    /// Llama-3-8B's KV shape (32 layers, 8 KV heads, dim 128, bf16): 16
    /// tokens per block = 2 MiB.
    #[staticmethod]
    #[pyo3(signature = (tokens_per_block=16))]
    fn llama3_8b(tokens_per_block: u32) -> PyResult<Self> {
        let l = KvLayout::llama3_8b(tokens_per_block);
        l.validate().map_err(crate::errors::from_client)?;
        Ok(Layout { inner: l })
    }

    /// A one-layer u8 layout whose blocks are exactly `nbytes` long (a
    /// positive multiple of 32), 16 tokens per block: for tests and benches.
    #[staticmethod]
    fn with_block_bytes(nbytes: u64) -> PyResult<Self> {
        let l = KvLayout::with_block_bytes(nbytes).map_err(crate::errors::from_client)?;
        l.validate().map_err(crate::errors::from_client)?;
        Ok(Layout { inner: l })
    }

    /// Bytes of one block.
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.inner.block_bytes()
    }
    /// Bytes of one layer's K and V of one block.
    #[getter]
    fn layer_bytes(&self) -> u64 {
        self.inner.layer_bytes()
    }
    #[getter]
    fn layers(&self) -> u32 {
        self.inner.layers
    }
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.inner.kv_heads
    }
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.inner.dtype)
    }
    #[getter]
    fn tokens_per_block(&self) -> u32 {
        self.inner.tokens_per_block
    }
    #[getter]
    fn layer_separate(&self) -> bool {
        self.inner.kind == LayoutKind::LayerSeparate
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "Layout(layers={}, kv_heads={}, head_dim={}, dtype={:?}, tokens_per_block={}, layer_separate={})",
            l.layers,
            l.kv_heads,
            l.head_dim,
            dtype_name(l.dtype),
            l.tokens_per_block,
            if l.kind == LayoutKind::LayerSeparate { "True" } else { "False" }
        )
    }
}

/// A KV namespace: model, layout, adapter (LoRA) and tenant salt, plus how
/// keys are made. Two namespaces never share a block; a tenant without the
/// salt cannot name another tenant's blocks.
///
/// hash_mode: "blake3" (default, 32-byte keys bound to the namespace),
/// "dynamo" (NVIDIA Dynamo's 64-bit sequence hashes, 8-byte keys; the salt
/// must be UTF-8) or "opaque" (the engine supplies its own keys;
/// hash_chain returns none). rank: one tensor/pipeline-parallel rank's
/// shard of the KV (a separate identity per rank).
#[pyclass(module = "kvtier", frozen, from_py_object)]
#[derive(Clone)]
pub(crate) struct Namespace {
    pub(crate) inner: kvtier_client::Namespace,
}

/// Tokens from a list of ints or a 1-d numpy integer array.
fn tokens_from(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    // Bytes are not token ids (each byte would pass for one): refused, as
    // a one-dimensional sequence of ints is what a prompt's tokens are.
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyByteArray>() {
        return Err(NamespaceError::new_err(
            "tokens are token ids, not bytes: pass a list of ints or a 1-d numpy integer array",
        ));
    }
    // Fast path: a contiguous integer buffer (numpy int32/uint32/int64/uint64).
    // SAFETY: an all-zero Py_buffer is a valid out-parameter.
    let mut v: ffi::Py_buffer = unsafe { std::mem::zeroed() };
    // SAFETY: obj is live; the GIL is held.
    let ok = unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) != 0 }
        && !obj.is_instance_of::<PyBytes>()
        // SAFETY: as above.
        && unsafe {
            ffi::PyObject_GetBuffer(
                obj.as_ptr(),
                &mut v,
                ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT,
            ) == 0
        };
    if ok {
        // SAFETY: a successful export: buf/len/itemsize/format are valid
        // until PyBuffer_Release.
        let r = unsafe {
            let fmt = if v.format.is_null() {
                "B".to_string()
            } else {
                std::ffi::CStr::from_ptr(v.format)
                    .to_string_lossy()
                    .into_owned()
            };
            let code = fmt
                .trim_start_matches(['<', '=', '@', '!', '>'])
                .to_string();
            let n = (v.len / v.itemsize.max(1)) as usize;
            let nd = v.ndim;
            if nd > 1 {
                ffi::PyBuffer_Release(&mut v);
                return Err(NamespaceError::new_err(format!(
                    "tokens: a {nd}-d array; pass one prompt's token ids as a 1-d array \
                     (hash each row on its own)"
                )));
            }
            let res: Result<Vec<u32>, String> = match (code.as_str(), v.itemsize) {
                ("I" | "L", 4) => Ok(std::slice::from_raw_parts(v.buf as *const u32, n).to_vec()),
                ("i" | "l", 4) => std::slice::from_raw_parts(v.buf as *const i32, n)
                    .iter()
                    .map(|&t| u32::try_from(t).map_err(|_| format!("token {t} is negative")))
                    .collect(),
                ("q" | "l", 8) => std::slice::from_raw_parts(v.buf as *const i64, n)
                    .iter()
                    .map(|&t| u32::try_from(t).map_err(|_| format!("token {t} is not in 0..2**32")))
                    .collect(),
                ("Q" | "L", 8) => std::slice::from_raw_parts(v.buf as *const u64, n)
                    .iter()
                    .map(|&t| u32::try_from(t).map_err(|_| format!("token {t} is not below 2**32")))
                    .collect(),
                _ => Err(format!(
                    "token array of format {fmt:?}: pass int32, uint32, int64 or uint64 token ids"
                )),
            };
            ffi::PyBuffer_Release(&mut v);
            res
        };
        return r.map_err(NamespaceError::new_err);
    }
    let _ = PyErr::take(obj.py());
    let not_ids =
        || NamespaceError::new_err("tokens must be a list of ints or a 1-d numpy integer array");
    let items: Vec<Bound<'_, PyAny>> = obj.extract().map_err(|_| not_ids())?;
    if let Some(i) = items.iter().position(|t| t.is_instance_of::<PyBool>()) {
        return Err(NamespaceError::new_err(format!(
            "token {i} is a bool, not a token id: pass ints"
        )));
    }
    let raw: Vec<i64> = items
        .iter()
        .map(|t| t.extract::<i64>())
        .collect::<PyResult<_>>()
        .map_err(|_| not_ids())?;
    raw.into_iter()
        .map(|t| {
            u32::try_from(t)
                .map_err(|_| NamespaceError::new_err(format!("token {t} is not in 0..2**32")))
        })
        .collect()
}

/// A key from bytes (1..=64), an int (a 64-bit hash, as Dynamo's and many
/// engines' are) or a hex string.
pub(crate) fn key_from(obj: &Bound<'_, PyAny>) -> PyResult<BlockKey> {
    let bad = |e: kvtier_client::Error| InvalidKeyError::new_err(e.to_string());
    // bool is an int subclass: True would pass for key 1.
    if obj.is_instance_of::<PyBool>() {
        return Err(InvalidKeyError::new_err(
            "a bool is not a block key: pass bytes (1..=64), an int in 0..2**64 or a hex string",
        ));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return BlockKey::from_bytes(b.as_bytes()).map_err(bad);
    }
    if let Ok(s) = obj.extract::<String>() {
        return BlockKey::from_hex(&s).map_err(bad);
    }
    if let Ok(v) = obj.extract::<u64>() {
        return Ok(BlockKey::from_u64(v));
    }
    Err(InvalidKeyError::new_err(format!(
        "a block key is bytes (1..=64), an int in 0..2**64 or a hex string, not {}",
        obj.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    )))
}

pub(crate) fn keys_from(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockKey>> {
    keys_from_until(obj, None)
}

/// [`keys_from`], stopping once `deadline` has passed (checked every 4096
/// keys): the keys converted by then, which a call made after its deadline
/// answers as a timeout without sending anything.
pub(crate) fn keys_from_until(
    obj: &Bound<'_, PyAny>,
    deadline: Option<std::time::Instant>,
) -> PyResult<Vec<BlockKey>> {
    if obj.is_instance_of::<PyBytes>() || obj.extract::<String>().is_ok() {
        return Err(InvalidKeyError::new_err(
            "keys must be a list of keys (as hash_chain returns), not one key",
        ));
    }
    let it = obj
        .try_iter()
        .map_err(|_| InvalidKeyError::new_err("keys must be a list of keys"))?;
    let mut out = Vec::new();
    for (i, k) in it.enumerate() {
        if i % 4096 == 4095 && deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            break;
        }
        out.push(
            key_from(&k?)
                .map_err(|e| InvalidKeyError::new_err(format!("key {i}: {}", e.value(obj.py()))))?,
        );
    }
    Ok(out)
}

pub(crate) fn keys_to_py<'py>(py: Python<'py>, keys: &[BlockKey]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k.as_bytes())))
}

#[pymethods]
impl Namespace {
    #[new]
    /// `tenant_salt`: bytes, or a str (its UTF-8 bytes, as the engine
    /// integrations read `kvtier_tenant_salt`); anything else is a
    /// kvtier.ArgumentTypeError that says so.
    #[pyo3(signature = (model, layout, adapter="", tenant_salt=None, hash_mode="blake3", rank=None))]
    fn new(
        model: &str,
        layout: &Layout,
        adapter: &str,
        tenant_salt: Option<&Bound<'_, PyAny>>,
        hash_mode: &str,
        rank: Option<u32>,
    ) -> PyResult<Self> {
        let tenant_salt: Vec<u8> = match tenant_salt {
            None => Vec::new(),
            Some(s) => {
                if let Ok(b) = s.cast::<PyBytes>() {
                    b.as_bytes().to_vec()
                } else if let Ok(t) = s.extract::<String>() {
                    t.into_bytes()
                } else {
                    let ty = s
                        .get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_else(|_| "?".into());
                    return Err(crate::errors::argument_type_error(
                        s.py(),
                        format!("tenant_salt must be bytes or str, not {ty}"),
                    ));
                }
            }
        };
        let mode = HashMode::parse(hash_mode).ok_or_else(|| {
            NamespaceError::new_err(format!(
                "hash_mode {hash_mode:?} is not \"blake3\", \"dynamo\" or \"opaque\""
            ))
        })?;
        let mut ns = kvtier_client::Namespace::new(model, layout.inner, adapter, tenant_salt)
            .and_then(|n| n.with_hash_mode(mode))
            .map_err(crate::errors::from_client)?;
        if let Some(r) = rank {
            ns = ns.with_rank(r);
        }
        Ok(Namespace { inner: ns })
    }

    /// Keys of every full block of `tokens` (a list of ints or a numpy
    /// integer array), as a list of bytes. A partial last block has no key.
    /// With `parent` (the key of the block before `tokens[0]`, e.g. the
    /// last key of an earlier call) the chain continues after it: a token
    /// list hashed in parts gets the keys of hashing it whole. Opaque
    /// namespaces return [] (their keys come from the engine).
    #[pyo3(signature = (tokens, parent=None))]
    fn hash_chain<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        parent: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let t = tokens_from(tokens)?;
        let parent = parent.map(key_from).transpose()?;
        let ns = self.inner.clone();
        let keys = py
            .detach(move || ns.hash_chain_after(parent, &t))
            .map_err(crate::errors::from_client)?;
        keys_to_py(py, &keys)
    }

    /// The namespace id (32 hex digits): its directory in G3, its prefix in
    /// G4 and in the mount.
    #[getter]
    fn id(&self) -> String {
        self.inner.id().to_string()
    }
    #[getter]
    fn model(&self) -> String {
        self.inner.model.clone()
    }
    #[getter]
    fn adapter(&self) -> String {
        self.inner.adapter.clone()
    }
    #[getter]
    fn layout(&self) -> Layout {
        Layout {
            inner: self.inner.layout,
        }
    }
    #[getter]
    fn hash_mode(&self) -> &'static str {
        self.inner.hash_mode.as_str()
    }
    #[getter]
    fn rank(&self) -> Option<u32> {
        self.inner.rank
    }
    /// Bytes of one block (the layout's).
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.inner.layout.block_bytes()
    }

    fn __repr__(&self) -> String {
        format!(
            "Namespace(model={:?}, id={}, hash_mode={:?}, block_bytes={})",
            self.inner.model,
            self.inner.id(),
            self.inner.hash_mode.as_str(),
            self.inner.layout.block_bytes()
        )
    }
}
