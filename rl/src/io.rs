//! Save and load parameters as safetensors with PyTorch-style names (`policy.0.weight` of shape
//! `[out, in]`, ...), so `safetensors.torch.load_file` reads them into an `nn.Sequential` of
//! `Linear`/`Tanh` layers. The [`ModelSpec`] is stored as JSON in the metadata under
//! [`SPEC_KEY`].

use std::path::Path;

use crate::mlp::{ModelSpec, ParamLayout};
use crate::tensor_io::{self, Tensor};
use crate::{NnError, Result};

/// Metadata key holding the model spec as JSON.
pub const SPEC_KEY: &str = "fedrl.model_spec";

/// Serialises `flat` (in `spec`'s layout) to safetensors bytes.
pub fn to_bytes(spec: &ModelSpec, flat: &[f32]) -> Result<Vec<u8>> {
    let layout = spec.layout();
    layout.check(flat)?;
    let tensors: Vec<Tensor> = layout
        .params
        .iter()
        .map(|p| {
            Tensor::f32(
                p.name.clone(),
                p.shape.clone(),
                &flat[p.offset..p.offset + p.numel()],
            )
        })
        .collect();
    let spec_json =
        serde_json::to_string(spec).map_err(|e| NnError::Invalid(format!("model spec: {e}")))?;
    tensor_io::serialize(&tensors, SPEC_KEY, spec_json)
}

/// Parses safetensors bytes written by [`to_bytes`]: the stored spec and the flat parameters.
pub fn from_bytes(bytes: &[u8]) -> Result<(ModelSpec, Vec<f32>)> {
    let json = tensor_io::metadata_entry(bytes, SPEC_KEY)?
        .ok_or_else(|| NnError::Invalid(format!("no {SPEC_KEY} in the metadata")))?;
    let spec: ModelSpec =
        serde_json::from_str(&json).map_err(|e| NnError::Invalid(format!("model spec: {e}")))?;
    let flat = from_bytes_with_layout(bytes, &spec.layout())?;
    Ok((spec, flat))
}

/// Reads the parameters of `layout` from safetensors bytes (names and shapes must match, F32).
pub fn from_bytes_with_layout(bytes: &[u8], layout: &ParamLayout) -> Result<Vec<f32>> {
    let st = tensor_io::parse(bytes)?;
    let mut flat = vec![0.0f32; layout.len()];
    for p in &layout.params {
        let values = tensor_io::read_f32(&st, &p.name, &p.shape)?;
        flat[p.offset..p.offset + p.numel()].copy_from_slice(&values);
    }
    Ok(flat)
}

/// Writes `flat` to a safetensors file.
pub fn save(path: &Path, spec: &ModelSpec, flat: &[f32]) -> Result<()> {
    std::fs::write(path, to_bytes(spec, flat)?)?;
    Ok(())
}

/// Reads a safetensors file written by [`save`].
pub fn load(path: &Path) -> Result<(ModelSpec, Vec<f32>)> {
    from_bytes(&std::fs::read(path)?)
}
