//! Reading fields of the reference trace files (JSON), with errors that name the field.

use crate::SimError;

pub(crate) fn field<'a>(
    v: &'a serde_json::Value,
    key: &str,
) -> Result<&'a serde_json::Value, SimError> {
    v.get(key)
        .ok_or_else(|| SimError::Trace(format!("lacks field {key:?}")))
}

pub(crate) fn num(v: &serde_json::Value, key: &str) -> Result<f64, SimError> {
    field(v, key)?
        .as_f64()
        .ok_or_else(|| SimError::Trace(format!("field {key:?} is not a number")))
}

pub(crate) fn nums(v: &serde_json::Value, key: &str) -> Result<Vec<f64>, SimError> {
    field(v, key)?
        .as_array()
        .ok_or_else(|| SimError::Trace(format!("field {key:?} is not an array")))?
        .iter()
        .map(|x| {
            x.as_f64()
                .ok_or_else(|| SimError::Trace(format!("field {key:?} holds a non-number")))
        })
        .collect()
}
