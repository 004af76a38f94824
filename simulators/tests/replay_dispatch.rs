//! `replay_file` recognises every reference trace format and reports unreadable input as errors.

use fedrl_sim::SimError;
use fedrl_sim::replay::{TraceFormat, detect_format, replay_file};

fn testdata(name: &str) -> String {
    format!("{}/../testdata/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn formats_are_recognised_from_contents() {
    let cases = [
        ("gymnasium_traces.json", TraceFormat::Gymnasium),
        ("simglucose_traces.json", TraceFormat::Simglucose),
        ("hiv_traces.json", TraceFormat::Hiv),
        ("dosing_traces.json", TraceFormat::Dosing),
    ];
    for (file, want) in cases {
        let text = std::fs::read_to_string(testdata(file)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(detect_format(&v).unwrap(), want, "{file}");
    }
}

#[test]
fn unreadable_unparsable_and_unknown_files_are_errors() {
    let dir = std::env::temp_dir().join(format!("fedrl-sim-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("missing.json");
    assert!(matches!(replay_file(&missing), Err(SimError::Trace(_))));
    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, b"{not json").unwrap();
    assert!(matches!(replay_file(&garbage), Err(SimError::Trace(_))));
    let unknown = dir.join("unknown.json");
    std::fs::write(&unknown, br#"{"meta": {"source": "something else"}}"#).unwrap();
    assert!(matches!(replay_file(&unknown), Err(SimError::Trace(_))));
    let csv = testdata("uva_padova_vpatient_params.csv");
    assert!(replay_file(csv).is_err());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn healthcare_trace_files_replay_through_the_dispatcher() {
    for file in [
        "hiv_traces.json",
        "dosing_traces.json",
        "simglucose_traces.json",
    ] {
        let results = replay_file(testdata(file)).unwrap();
        assert!(!results.is_empty(), "{file}");
        for r in &results {
            assert!(r.pass, "{file}: {r:?}");
        }
    }
}
