//! Save and load parameters as safetensors with PyTorch-style names (`policy.0.weight` of shape
//! `[out, in]`, ...), so `safetensors.torch.load_file` reads them into an `nn.Sequential` of
//! `Linear`/`Tanh` layers. The [`ModelSpec`] is stored as JSON in the metadata under
//! [`SPEC_KEY`].

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::mlp::{ModelSpec, ParamLayout};
use crate::{NnError, Result};

/// Metadata key holding the model spec as JSON.
pub const SPEC_KEY: &str = "fedrl.model_spec";

/// Serialises `flat` (in `spec`'s layout) to safetensors bytes.
pub fn to_bytes(spec: &ModelSpec, flat: &[f32]) -> Result<Vec<u8>> {
    let layout = spec.layout();
    layout.check(flat)?;
    let bytes: Vec<Vec<u8>> = layout
        .params
        .iter()
        .map(|p| {
            flat[p.offset..p.offset + p.numel()]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect()
        })
        .collect();
    let mut views = Vec::with_capacity(layout.params.len());
    for (p, b) in layout.params.iter().zip(&bytes) {
        views.push((
            p.name.clone(),
            TensorView::new(Dtype::F32, p.shape.clone(), b)?,
        ));
    }
    let spec_json =
        serde_json::to_string(spec).map_err(|e| NnError::Invalid(format!("model spec: {e}")))?;
    let meta = HashMap::from([(SPEC_KEY.to_string(), spec_json)]);
    Ok(safetensors::serialize(views, Some(meta))?)
}

/// Parses safetensors bytes written by [`to_bytes`]: the stored spec and the flat parameters.
pub fn from_bytes(bytes: &[u8]) -> Result<(ModelSpec, Vec<f32>)> {
    let (_, meta) = SafeTensors::read_metadata(bytes)?;
    let json = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get(SPEC_KEY))
        .ok_or_else(|| NnError::Invalid(format!("no {SPEC_KEY} in the metadata")))?;
    let spec: ModelSpec =
        serde_json::from_str(json).map_err(|e| NnError::Invalid(format!("model spec: {e}")))?;
    let flat = from_bytes_with_layout(bytes, &spec.layout())?;
    Ok((spec, flat))
}

/// Reads the parameters of `layout` from safetensors bytes (names and shapes must match, F32).
pub fn from_bytes_with_layout(bytes: &[u8], layout: &ParamLayout) -> Result<Vec<f32>> {
    let st = SafeTensors::deserialize(bytes)?;
    let mut flat = vec![0.0f32; layout.len()];
    for p in &layout.params {
        let t = st.tensor(&p.name)?;
        if t.dtype() != Dtype::F32 || t.shape() != p.shape.as_slice() {
            return Err(NnError::Invalid(format!(
                "{}: {:?} {:?}, expected F32 {:?}",
                p.name,
                t.dtype(),
                t.shape(),
                p.shape
            )));
        }
        for (dst, chunk) in flat[p.offset..p.offset + p.numel()]
            .iter_mut()
            .zip(t.data().chunks_exact(4))
        {
            *dst = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
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
