//! A JSON Schema checker for the subset of draft 2020-12 that `scenarios/report.schema.json`
//! uses (`type`, `const`, `enum`, `required`, `properties`, `additionalProperties`, `items`,
//! `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `oneOf`, local `$ref`; annotations are
//! ignored). A keyword outside the subset is an error, so the schema cannot use one that this
//! checker would silently skip. Test code: a full validator crate would rebuild much of the
//! workspace's dependencies with other features, for these few keywords.

use serde_json::Value;

/// Every violation of `schema` by `instance`, as `path: what`; empty when it conforms.
pub fn violations(schema: &Value, instance: &Value) -> Vec<String> {
    let mut out = Vec::new();
    check(schema, schema, instance, "$", &mut out);
    out
}

const ANNOTATIONS: [&str; 5] = ["$schema", "$id", "title", "description", "$defs"];

fn type_ok(t: &str, v: &Value) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        other => panic!("unknown type {other:?} in the schema"),
    }
}

fn resolve<'a>(root: &'a Value, reference: &str) -> &'a Value {
    let path = reference
        .strip_prefix("#/")
        .unwrap_or_else(|| panic!("only local references are supported: {reference}"));
    let v = path.split('/').fold(root, |v, part| &v[part]);
    assert!(v.is_object(), "unresolved reference {reference}");
    v
}

fn check(root: &Value, schema: &Value, v: &Value, path: &str, out: &mut Vec<String>) {
    let Some(s) = schema.as_object() else {
        panic!("a schema must be an object at {path}: {schema}");
    };
    for (k, rule) in s {
        match k.as_str() {
            k if ANNOTATIONS.contains(&k) => {}
            "$ref" => check(root, resolve(root, rule.as_str().unwrap()), v, path, out),
            "type" => {
                let ok = match rule {
                    Value::String(t) => type_ok(t, v),
                    Value::Array(ts) => ts.iter().any(|t| type_ok(t.as_str().unwrap(), v)),
                    _ => panic!("bad type keyword at {path}"),
                };
                if !ok {
                    out.push(format!("{path}: {v} is not of type {rule}"));
                }
            }
            "const" => {
                if v != rule {
                    out.push(format!("{path}: {v} is not {rule}"));
                }
            }
            "enum" => {
                if !rule.as_array().unwrap().contains(v) {
                    out.push(format!("{path}: {v} is not one of {rule}"));
                }
            }
            "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" => {
                if let (Some(x), Some(b)) = (v.as_f64(), rule.as_f64()) {
                    let ok = match k.as_str() {
                        "minimum" => x >= b,
                        "maximum" => x <= b,
                        "exclusiveMinimum" => x > b,
                        _ => x < b,
                    };
                    if !ok {
                        out.push(format!("{path}: {x} violates {k} {b}"));
                    }
                }
            }
            "required" => {
                if let Some(o) = v.as_object() {
                    for r in rule.as_array().unwrap() {
                        let r = r.as_str().unwrap();
                        if !o.contains_key(r) {
                            out.push(format!("{path}: required field {r} is missing"));
                        }
                    }
                }
            }
            "properties" => {
                if let Some(o) = v.as_object() {
                    for (name, sub) in rule.as_object().unwrap() {
                        if let Some(x) = o.get(name) {
                            check(root, sub, x, &format!("{path}.{name}"), out);
                        }
                    }
                }
            }
            "additionalProperties" => {
                if let Some(o) = v.as_object() {
                    let declared = s.get("properties").and_then(Value::as_object);
                    for (name, x) in o {
                        if declared.is_some_and(|d| d.contains_key(name)) {
                            continue;
                        }
                        match rule {
                            Value::Bool(false) => {
                                out.push(format!("{path}: field {name} is not in the schema"))
                            }
                            Value::Bool(true) => {}
                            sub => check(root, sub, x, &format!("{path}.{name}"), out),
                        }
                    }
                }
            }
            "items" => {
                if let Some(a) = v.as_array() {
                    for (i, x) in a.iter().enumerate() {
                        check(root, rule, x, &format!("{path}[{i}]"), out);
                    }
                }
            }
            "oneOf" => {
                let results: Vec<Vec<String>> = rule
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|sub| {
                        let mut o = Vec::new();
                        check(root, sub, v, path, &mut o);
                        o
                    })
                    .collect();
                let passing = results.iter().filter(|r| r.is_empty()).count();
                if passing != 1 {
                    out.push(format!(
                        "{path}: matches {passing} of the oneOf schemas (must match exactly 1): {results:?}"
                    ));
                }
            }
            other => {
                panic!("schema keyword {other:?} (at {path}) is outside this checker's subset")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The checker finds what it must: a missing field, a wrong type, a field not in the
    /// schema, a value out of range, a oneOf that matches none.
    #[test]
    fn the_checker_rejects_what_the_schema_forbids() {
        let schema = json!({
            "oneOf": [{ "$ref": "#/$defs/a" }],
            "$defs": { "a": {
                "type": "object", "additionalProperties": false, "required": ["x", "v"],
                "properties": {
                    "x": { "type": ["number", "null"], "minimum": 0 },
                    "v": { "const": 2 },
                    "k": { "enum": ["p", "q"] },
                    "l": { "type": "array", "items": { "type": "integer" } }
                }
            } }
        });
        assert!(violations(&schema, &json!({"x": 1.5, "v": 2, "k": "p", "l": [1, 2]})).is_empty());
        assert!(violations(&schema, &json!({"x": null, "v": 2})).is_empty());
        for bad in [
            json!({"v": 2}),
            json!({"x": "1", "v": 2}),
            json!({"x": -1, "v": 2}),
            json!({"x": 1, "v": 3}),
            json!({"x": 1, "v": 2, "k": "r"}),
            json!({"x": 1, "v": 2, "l": [1.5]}),
            json!({"x": 1, "v": 2, "extra": true}),
        ] {
            assert!(!violations(&schema, &bad).is_empty(), "{bad} passed");
        }
    }
}
