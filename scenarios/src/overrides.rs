//! `--set key=value`: command-line overrides of scenario fields, for sweeps without copying TOML
//! files (`--set task.clip_norm=0.5 --set rounds=20`).
//!
//! Invariants: an override is applied to the scenario's TOML text before it is parsed, so the
//! overridden scenario goes through exactly the validation a file does (unknown keys and wrong
//! types are refused by the scenario's own schema, `noise_multiplier = "auto"` is resolved
//! after the override); the value is parsed as a TOML value (`0.5`, `20`, `true`, `[64, 64]`,
//! `"text"`), and a value that is not TOML is taken as a bare string (`--set
//! task.population=CartPole-v1`); an error names the `--set` at fault.

use std::fmt;

/// One `--set KEY=VALUE`: a dotted path into the scenario and the TOML value to put there.
#[derive(Clone, Debug, PartialEq)]
pub struct Override {
    /// The dotted path, e.g. `task.clip_norm`.
    pub key: String,
    /// The value, typed as TOML reads it.
    pub value: toml::Value,
}

impl fmt::Display for Override {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "--set {}={}", self.key, self.value)
    }
}

/// Parses `KEY=VALUE` (clap's value parser for `--set`).
pub fn parse(arg: &str) -> Result<Override, String> {
    let (key, value) = arg
        .split_once('=')
        .ok_or_else(|| format!("expected KEY=VALUE (e.g. task.clip_norm=0.5), got {arg:?}"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(|part| part.trim().is_empty()) {
        return Err(format!(
            "{arg:?}: the key must be a dotted path of field names (e.g. task.clip_norm)"
        ));
    }
    let value = value.trim();
    // A TOML value in a one-line document; anything else (CartPole-v1, auto) is a string.
    let value = match format!("v = {value}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| value.into()),
        Err(_) => toml::Value::String(value.to_string()),
    };
    Ok(Override {
        key: key.split('.').map(str::trim).collect::<Vec<_>>().join("."),
        value,
    })
}

/// Why the overrides could not be applied to the scenario's text.
#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    #[error("the scenario is not valid TOML: {0}")]
    Toml(#[from] toml::de::Error),
    #[error("{set}: `{prefix}` is a value ({found}), not a table of fields")]
    NotATable {
        set: String,
        prefix: String,
        found: String,
    },
}

/// `text` (a scenario's TOML) with every override applied in order (a later one wins). A
/// missing table on the way is created (`--set churn.dropout=0.1` on a scenario without
/// `[churn]`); whether the key exists and the value has its type is the scenario parser's to
/// say ([`check`]).
pub fn apply(text: &str, overrides: &[Override]) -> Result<String, OverrideError> {
    let mut doc: toml::Table = text.parse()?;
    for o in overrides {
        let parts: Vec<&str> = o.key.split('.').collect();
        let (last, path) = parts.split_last().expect("a key has at least one part");
        let mut table = &mut doc;
        for (i, part) in path.iter().enumerate() {
            let entry = table
                .entry(part.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = match entry {
                toml::Value::Table(t) => t,
                other => {
                    return Err(OverrideError::NotATable {
                        set: o.to_string(),
                        prefix: parts[..=i].join("."),
                        found: other.to_string(),
                    });
                }
            };
        }
        table.insert(last.to_string(), o.value.clone());
    }
    Ok(doc.to_string())
}

/// Applies `overrides` to `text` and parses the result with `parse` (the scenario's own
/// loader). When the base scenario parses but the overridden one does not, the error names the
/// first override that breaks it (applied one by one), or all of them when only their
/// combination fails.
pub fn load<T, E: fmt::Display>(
    text: &str,
    overrides: &[Override],
    parse: impl Fn(&str) -> Result<T, E>,
) -> anyhow::Result<T> {
    if overrides.is_empty() {
        return parse(text).map_err(|e| anyhow::anyhow!("{e}"));
    }
    let full = apply(text, overrides)?;
    match parse(&full) {
        Ok(s) => Ok(s),
        Err(e) => {
            // Which --set broke it: the base must parse first (else it is the file's error).
            parse(text).map_err(|e| anyhow::anyhow!("{e}"))?;
            for k in 1..=overrides.len() {
                let partial = apply(text, &overrides[..k])?;
                if let Err(e) = parse(&partial) {
                    return Err(anyhow::anyhow!(
                        "{}: {}",
                        overrides[k - 1],
                        explain(&overrides[k - 1], &e.to_string())
                    ));
                }
            }
            let sets: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
            Err(anyhow::anyhow!("{}: {e}", sets.join(" ")))
        }
    }
}

/// The parser's message, with a plain sentence first for the two common mistakes (a field the
/// schema does not have, a value of the wrong type).
fn explain(o: &Override, message: &str) -> String {
    // The parser's position refers to the re-written text, which the user never saw: keep its
    // last line (the reason), without a line number.
    let mut message = message
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or(message)
        .trim()
        .to_string();
    if let Some(start) = message.find(" (line ")
        && let Some(len) = message[start..].find("):")
    {
        message.replace_range(start..start + len + 1, "");
    }
    if message.contains("unknown field") {
        format!("the scenario has no field `{}` ({message})", o.key)
    } else if message.contains("invalid type") || message.contains("invalid value") {
        format!(
            "`{}` does not take the value {} ({message})",
            o.key, o.value
        )
    } else {
        message
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_typed_as_toml_and_bare_words_are_strings() {
        let o = parse("task.clip_norm=0.5").unwrap();
        assert_eq!(o.key, "task.clip_norm");
        assert_eq!(o.value, toml::Value::Float(0.5));
        assert_eq!(parse("rounds=20").unwrap().value, toml::Value::Integer(20));
        assert_eq!(
            parse("task.population=CartPole-v1").unwrap().value,
            toml::Value::String("CartPole-v1".into())
        );
        assert_eq!(
            parse("task.hidden=[64, 64]").unwrap().value,
            toml::Value::Array(vec![toml::Value::Integer(64), toml::Value::Integer(64)])
        );
        assert_eq!(
            parse("name=\"a b\"").unwrap().value,
            toml::Value::String("a b".into())
        );
        assert!(parse("rounds").is_err());
        assert!(parse("=3").is_err());
        assert!(parse("task..x=3").is_err());
    }

    #[test]
    fn apply_sets_nested_keys_and_creates_tables() {
        let text = "rounds = 3\n[task]\nkind = \"k\"\nclip_norm = 1.0\n";
        let out = apply(
            text,
            &[
                parse("task.clip_norm=0.5").unwrap(),
                parse("rounds=20").unwrap(),
                parse("churn.dropout=0.1").unwrap(),
            ],
        )
        .unwrap();
        let t: toml::Table = out.parse().unwrap();
        assert_eq!(t["rounds"].as_integer(), Some(20));
        assert_eq!(t["task"]["clip_norm"].as_float(), Some(0.5));
        assert_eq!(t["task"]["kind"].as_str(), Some("k"));
        assert_eq!(t["churn"]["dropout"].as_float(), Some(0.1));
        let err = apply(text, &[parse("rounds.x=1").unwrap()]).unwrap_err();
        assert!(err.to_string().contains("`rounds` is a value"), "{err}");
    }

    /// The scenario's own parser types the value and refuses unknown keys; the error names the
    /// `--set` at fault, and a good override goes through validation like a file.
    #[test]
    fn load_names_the_override_at_fault() {
        let text = "rounds = 3\n[task]\nkind = \"mean_estimation\"\ndim = 4\n";
        let load_with = |sets: &[&str]| {
            let sets: Vec<Override> = sets.iter().map(|s| parse(s).unwrap()).collect();
            load(text, &sets, fedrl_tasks::scenario_from_toml_str)
        };
        let s = load_with(&["task.dim=8", "rounds=5", "clip_norm=2"]).unwrap();
        assert_eq!((s.rounds, s.clip_norm), (5, 2.0));
        // Validated like a file: 20 rounds of 10 fresh users need more than 100 users.
        let err = format!("{:#}", load_with(&["rounds=20"]).unwrap_err());
        assert!(
            err.starts_with("--set rounds=20: ") && err.contains("users (100)"),
            "{err}"
        );
        let err = format!("{:#}", load_with(&["rounds=5", "task.dimm=8"]).unwrap_err());
        assert!(
            err.starts_with("--set task.dimm=8: the scenario has no field `task.dimm`"),
            "{err}"
        );
        assert!(!err.contains("line"), "{err}");
        let err = format!("{:#}", load_with(&["rounds=2.5"]).unwrap_err());
        assert!(
            err.contains("--set rounds=2.5: `rounds` does not take the value 2.5")
                && err.contains("expected u64"),
            "{err}"
        );
        let err = format!("{:#}", load_with(&["task.dim=many"]).unwrap_err());
        assert!(
            err.contains("`task.dim` does not take the value \"many\""),
            "{err}"
        );
        // Validated like a file: a value of the right type but out of range is refused.
        let err = format!("{:#}", load_with(&["clip_norm=-1"]).unwrap_err());
        assert!(err.starts_with("--set clip_norm=-1: "), "{err}");
    }
}
