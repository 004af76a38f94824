//! Safetensors reading and writing, in one place: every file this crate stores (policies,
//! ensembles, SAC agents, log-linear policies, experts, continuous datasets) is built and read
//! through these helpers, and each caller only names its tensors, shapes and metadata key.
//!
//! Invariants: values are stored little-endian (safetensors' layout); a file carries one JSON
//! metadata entry under its format's key, so the same content always gives the same bytes
//! (safetensors writes its metadata map in `HashMap` order, and the tensors sorted by name); a
//! tensor is read only after its dtype (and, where the caller knows it, its shape) is checked.

use std::collections::HashMap;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::{NnError, Result};

/// One tensor to write: its name, element type, shape and little-endian bytes.
pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl Tensor {
    /// An F32 tensor of `shape` holding `values` (row-major).
    pub fn f32(name: impl Into<String>, shape: Vec<usize>, values: &[f32]) -> Self {
        Tensor {
            name: name.into(),
            dtype: Dtype::F32,
            shape,
            bytes: f32_bytes(values),
        }
    }
}

/// Serialises `tensors` with one metadata entry, `meta_key` = `meta_json`.
pub fn serialize(tensors: &[Tensor], meta_key: &str, meta_json: String) -> Result<Vec<u8>> {
    let mut views = Vec::with_capacity(tensors.len());
    for t in tensors {
        views.push((
            t.name.as_str(),
            TensorView::new(t.dtype, t.shape.clone(), &t.bytes)?,
        ));
    }
    let meta = HashMap::from([(meta_key.to_string(), meta_json)]);
    Ok(safetensors::serialize(views, Some(meta))?)
}

/// Parses safetensors `bytes` (header checked; the tensors borrow `bytes`).
pub fn parse(bytes: &[u8]) -> Result<SafeTensors<'_>> {
    Ok(SafeTensors::deserialize(bytes)?)
}

/// The metadata map of safetensors `bytes` (read from the header alone), if it has one.
pub fn metadata(bytes: &[u8]) -> Result<Option<HashMap<String, String>>> {
    let (_, header) = SafeTensors::read_metadata(bytes)?;
    Ok(header.metadata().clone())
}

/// The metadata entry `key` of safetensors `bytes`; `None` when the file has no such entry.
pub fn metadata_entry(bytes: &[u8], key: &str) -> Result<Option<String>> {
    Ok(metadata(bytes)?.and_then(|mut m| m.remove(key)))
}

/// The bytes of tensor `name`, checked to be of `dtype` (and of `shape`, when given).
pub fn tensor_bytes<'data>(
    st: &SafeTensors<'data>,
    name: &str,
    dtype: Dtype,
    shape: Option<&[usize]>,
) -> Result<&'data [u8]> {
    let t = st.tensor(name)?;
    match shape {
        Some(shape) if t.dtype() != dtype || t.shape() != shape => Err(NnError::Invalid(format!(
            "{name}: {:?} {:?}, expected {dtype:?} {shape:?}",
            t.dtype(),
            t.shape()
        ))),
        None if t.dtype() != dtype => Err(NnError::Invalid(format!(
            "{name}: {:?}, expected {dtype:?}",
            t.dtype()
        ))),
        _ => Ok(t.data()),
    }
}

/// Tensor `name`, checked to be F32 of `shape`, as values.
pub fn read_f32(st: &SafeTensors<'_>, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    Ok(le_f32s(tensor_bytes(st, name, Dtype::F32, Some(shape))?))
}

/// The little-endian bytes of `xs`.
pub fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// f32 values from little-endian bytes (a trailing partial value is ignored; the callers check
/// lengths through shapes or counts).
pub fn le_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// i64 values from little-endian bytes.
pub fn le_i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_checks_dtype_and_shape() {
        let bytes = serialize(
            &[
                Tensor::f32("b", vec![2], &[1.5, -2.0]),
                Tensor::f32("a", vec![1, 3], &[0.0, 1.0, 2.0]),
            ],
            "k",
            "{\"x\":1}".into(),
        )
        .unwrap();
        assert_eq!(
            metadata_entry(&bytes, "k").unwrap().as_deref(),
            Some("{\"x\":1}")
        );
        assert_eq!(metadata_entry(&bytes, "other").unwrap(), None);
        let st = parse(&bytes).unwrap();
        assert_eq!(read_f32(&st, "a", &[1, 3]).unwrap(), vec![0.0, 1.0, 2.0]);
        assert_eq!(read_f32(&st, "b", &[2]).unwrap(), vec![1.5, -2.0]);
        let err = read_f32(&st, "a", &[3]).unwrap_err().to_string();
        assert!(err.contains("expected F32 [3]"), "{err}");
        let err = tensor_bytes(&st, "b", Dtype::I64, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("expected I64"), "{err}");
        assert!(read_f32(&st, "c", &[1]).is_err());
        // The order the tensors are given in does not change the bytes.
        let again = serialize(
            &[
                Tensor::f32("a", vec![1, 3], &[0.0, 1.0, 2.0]),
                Tensor::f32("b", vec![2], &[1.5, -2.0]),
            ],
            "k",
            "{\"x\":1}".into(),
        )
        .unwrap();
        assert_eq!(bytes, again);
    }
}
