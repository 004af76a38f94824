//! `fedrl privacy`: JSON output against dp_accounting's figures, human output, and one-line
//! errors with exit code 2 for bad arguments.

use serde_json::Value;

mod e2e_support;

/// `fedrl privacy ARGS`: (exit code, stdout, stderr).
fn fedrl(args: &[&str]) -> (i32, String, String) {
    e2e_support::fedrl_output(&[&["privacy"], args].concat())
}

/// `fedrl privacy ARGS`, which must succeed with one JSON object.
fn json(args: &[&str]) -> Value {
    e2e_support::fedrl_json(&[&["privacy"], args].concat())
}

fn rel(a: f64, b: f64) -> f64 {
    ((a - b) / b).abs()
}

#[test]
fn epsilon_matches_dp_accounting_with_both_accountants() {
    let base = [
        "epsilon",
        "--noise-multiplier",
        "1.1",
        "--sampling-rate",
        "0.004266666666666667",
    ];
    let rest = ["--steps", "14062", "--delta", "1e-5", "--json"];
    let args: Vec<&str> = base.iter().chain(rest.iter()).copied().collect();
    let v = json(&args);
    assert_eq!(v["accountant"], "pld");
    assert!(
        rel(v["epsilon"].as_f64().unwrap_or(0.0), 2.3816860032302603) < 1e-6,
        "{v}"
    );
    assert_eq!(v["steps"], 14062);
    let mut rdp = args.clone();
    rdp.extend(["--accountant", "rdp"]);
    let v = json(&rdp);
    assert_eq!(v["accountant"], "rdp");
    assert!(
        rel(v["epsilon"].as_f64().unwrap_or(0.0), 2.5965558697943036) < 1e-9,
        "{v}"
    );
}

#[test]
fn noise_round_trips_through_epsilon() {
    let v = json(&[
        "noise",
        "--epsilon",
        "2.0",
        "--delta",
        "1e-5",
        "--sampling-rate",
        "0.01",
        "--steps",
        "1000",
        "--json",
    ]);
    let z = v["noise_multiplier"].as_f64().unwrap_or(0.0);
    assert!(z > 0.5 && z < 2.0, "{v}");
    let zs = z.to_string();
    let back = json(&[
        "epsilon",
        "--noise-multiplier",
        &zs,
        "--sampling-rate",
        "0.01",
        "--steps",
        "1000",
        "--delta",
        "1e-5",
        "--json",
    ]);
    let e = back["epsilon"].as_f64().unwrap_or(f64::NAN);
    assert!(e <= 2.0 && e > 1.99, "{back}");
}

#[test]
fn gaussian_is_exact_and_human_output_is_one_line() {
    let v = json(&["gaussian", "--sigma", "1.0", "--delta", "1e-7", "--json"]);
    assert!(
        rel(v["epsilon"].as_f64().unwrap_or(0.0), 5.3493454057768375) < 1e-9,
        "{v}"
    );
    let (code, stdout, _) = fedrl(&["gaussian", "--sigma", "1.0", "--delta", "1e-7"]);
    assert_eq!(code, 0);
    assert_eq!(stdout.lines().count(), 1);
    assert!(stdout.contains("epsilon = 5.349345"), "{stdout}");
}

#[test]
fn bad_arguments_exit_2_with_one_line() {
    let cases: &[&[&str]] = &[
        &["gaussian", "--sigma", "-1", "--delta", "1e-5"],
        &["gaussian", "--sigma", "NaN", "--delta", "1e-5"],
        &["gaussian", "--sigma", "1", "--delta", "1"],
        &[
            "epsilon",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0",
            "--steps",
            "3",
            "--delta",
            "1e-5",
        ],
        &[
            "epsilon",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "1.5",
            "--steps",
            "3",
            "--delta",
            "1e-5",
        ],
        &[
            "epsilon",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0.1",
            "--steps",
            "0",
            "--delta",
            "1e-5",
        ],
        &[
            "epsilon",
            "--noise-multiplier",
            "-2",
            "--sampling-rate",
            "0.1",
            "--steps",
            "3",
            "--delta",
            "1e-5",
        ],
        &[
            "epsilon",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0.1",
            "--steps",
            "3",
            "--delta",
            "0",
        ],
        &[
            "epsilon",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0.1",
            "--steps",
            "3",
            "--delta",
            "1e-5",
            "--accountant",
            "moments",
        ],
        &[
            "noise",
            "--epsilon",
            "-1",
            "--delta",
            "1e-5",
            "--sampling-rate",
            "0.1",
            "--steps",
            "3",
        ],
        &[
            "noise",
            "--epsilon",
            "NaN",
            "--delta",
            "1e-5",
            "--sampling-rate",
            "0.1",
            "--steps",
            "3",
        ],
    ];
    for args in cases {
        let (code, stdout, stderr) = fedrl(args);
        assert_eq!(code, 2, "{args:?}: {stdout} {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("error:"), "{stderr}");
    }
}
