//! `fedrl ledger`: lists every record's event and re-accounts with either accountant; reads the
//! first release's ledgers; `fedrl run` with `noise_multiplier = "auto"` writes the resolved
//! number into the output `scenario.toml`, and its ledger reads back through the command.

use std::path::{Path, PathBuf};

use fedrl_common::privacy::DpEvent;
use fedrl_common::privacy::ledger::{
    LedgerConfig, OpenPolicy, Participation, PrivacyLedger, RoundRecord, UnitKind,
};
use fedrl_common::privacy::noise::NoiseSource;
use fedrl_common::scenario::Scenario;
use serde_json::Value;

mod e2e_support;

use e2e_support::{fedrl_json as json, fedrl_output as fedrl};

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// A ledger with two phases, three kinds of event and a recorded budget raise.
fn mixed_ledger(dir: &Path) -> PathBuf {
    let path = dir.join("privacy.ledger");
    let mut cfg = LedgerConfig {
        target_epsilon: 20.0,
        delta: 1e-5.try_into().unwrap(),
        unit_kind: UnitKind::Expert,
        participation: Participation::sampled(0.25).unwrap(),
    };
    let (mut l, _) = PrivacyLedger::open(&path, cfg.clone()).unwrap();
    for r in 1..=4 {
        let mut rec = RoundRecord::gaussian_round(
            r,
            vec![r, r + 10],
            1.2,
            1.0,
            Some(0.25),
            5.0,
            NoiseSource::Os,
        );
        rec.unix_time_s = 1.7e9;
        l.append(rec).unwrap();
    }
    drop(l);
    cfg.target_epsilon = 30.0;
    let allow = OpenPolicy {
        allow_budget_increase: true,
    };
    let (mut l, _) = PrivacyLedger::open_with(&path, cfg, allow).unwrap();
    l.append(RoundRecord {
        round: 5,
        phase: "release".into(),
        event: DpEvent::Laplace { scale: 2.0 },
        sampled_by_aggregator: false,
        units: vec![1, 2, 3],
        clip_norm: None,
        expected_cohort: None,
        noise_source: NoiseSource::Os,
        unix_time_s: 1.7e9,
    })
    .unwrap();
    path
}

#[test]
fn json_lists_every_event_and_both_accountants_re_account() {
    let dir = tempfile::tempdir().unwrap();
    mixed_ledger(dir.path());
    let d = dir.path().to_str().unwrap();
    let v = json(&["ledger", d, "--json"]);
    assert_eq!(v["format_version"], 3);
    assert_eq!(v["chain"]["chained"], true);
    assert_eq!(v["chain"]["entries"], 6);
    let entries = v["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 6, "{v}");
    assert_eq!(entries[0]["entry"], "round");
    assert_eq!(entries[0]["phase"], "training");
    assert_eq!(entries[0]["sampled_by_aggregator"], true);
    assert_eq!(entries[0]["unit_count"], 2);
    assert_eq!(entries[0]["event"]["kind"], "poisson_sampled");
    assert_eq!(entries[0]["event"]["sampling_rate"], 0.25);
    assert_eq!(entries[0]["event"]["event"]["kind"], "gaussian");
    assert_eq!(entries[4]["entry"], "budget_change");
    assert_eq!((f(&entries[4]["from"]), f(&entries[4]["to"])), (20.0, 30.0));
    assert_eq!(entries[5]["event"]["kind"], "laplace");
    assert_eq!(entries[5]["sampled_by_aggregator"], false);
    // Unit lists stay out of the record listing.
    assert!(entries[0].get("units").is_none());

    assert_eq!(v["accountant"], "pld");
    assert_eq!(v["target_epsilon"], 30.0);
    let phases = v["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2);
    assert_eq!(phases[1]["phase"], "release");
    let eps = f(&v["epsilon"]);
    let basic = f(&v["epsilon_basic"]);
    assert!(eps > 0.0 && basic > eps, "{v}");
    assert!((basic - (f(&phases[0]["epsilon"]) + f(&phases[1]["epsilon"]))).abs() < 1e-12);
    assert!(f(&v["epsilon_rdp"]) >= eps);
    assert_eq!(v["budget_changes"].as_array().unwrap().len(), 1);

    // The same figures from the library.
    let report = PrivacyLedger::read_file(dir.path().join("privacy.ledger"))
        .unwrap()
        .report(Default::default())
        .unwrap();
    assert_eq!(report.epsilon, eps);

    let r = json(&["ledger", d, "--json", "--accountant", "rdp"]);
    assert_eq!(r["accountant"], "rdp");
    assert!(f(&r["epsilon"]) >= eps, "{r}");
    assert_eq!(f(&r["epsilon"]), f(&r["epsilon_rdp"]));
    assert!(f(&r["epsilon_basic"]) >= f(&r["epsilon"]));

    let (code, _, stderr) = fedrl(&["ledger", d, "--accountant", "moments"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--accountant must be pld or rdp"),
        "{stderr}"
    );
}

#[test]
fn text_shows_records_phases_budget_changes_and_the_basic_sum() {
    let dir = tempfile::tempdir().unwrap();
    let path = mixed_ledger(dir.path());
    let (code, out, stderr) = fedrl(&["ledger", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    for needle in [
        "format version 3",
        "chain         6 entries, head SHA-256 ",
        "Poisson-sampled q=0.25: Gaussian z=1.2000",
        "Laplace b=2",
        "participation sampled (the aggregator draws each unit with probability 0.25",
        "budget change: target epsilon 20 -> 30",
        "release",
        "basic sum",
        "RDP check",
    ] {
        assert!(out.contains(needle), "{needle:?} missing:\n{out}");
    }
}

/// The first release's ledger (format 1) reads through the command with the figure that release
/// reported (`common/tests/fixtures/README.md`).
#[test]
fn version_one_ledger_reads_with_its_landed_epsilon() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../common/tests/fixtures/ledger-v1.ledger");
    let v = json(&["ledger", fixture.to_str().unwrap(), "--json"]);
    assert_eq!(v["format_version"], 1);
    assert_eq!(v["chain"]["chained"], false);
    assert_eq!(v["recovery"]["unchained_entries"], 9);
    let landed = 4.39541998826949;
    assert!((f(&v["epsilon"]) - landed).abs() < 1e-12 * landed, "{v}");
    let entries = v["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 9);
    // Round 6 was sampled at rate 1: a plain Gaussian charged to everybody.
    assert_eq!(entries[6]["event"]["kind"], "gaussian");
    assert_eq!(entries[6]["sampled_by_aggregator"], true);
    assert_eq!(entries[7]["sampled_by_aggregator"], false);
}

/// `noise_multiplier = "auto"` is resolved once, by the ledger's accountant entry point, and the
/// output `scenario.toml` carries that number (so the file says what ran).
#[test]
fn fedrl_run_writes_the_resolved_noise_multiplier() {
    let dir = tempfile::tempdir().unwrap();
    let text = r#"
name = "auto-noise"
seed = 5
rounds = 3
users = 24
participation = { kind = "sampled", rate = 0.5 }
quorum = 1
round_deadline_s = 10.0
noise_multiplier = "auto"
target_epsilon = 8.0

[task]
kind = "mean_estimation"
dim = 4
"#;
    let scenario = dir.path().join("s.toml");
    std::fs::write(&scenario, text).unwrap();
    let out = dir.path().join("out");
    let (code, stdout, stderr) = fedrl(&[
        "run",
        scenario.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}\n{stdout}");
    let expected = Scenario::from_toml_str(text).unwrap().noise_multiplier;
    assert!(expected.is_finite() && expected > 0.0);
    let written = std::fs::read_to_string(out.join("scenario.toml")).unwrap();
    assert!(!written.contains("\"auto\""), "{written}");
    let resolved = Scenario::from_toml_str(&written).unwrap();
    assert_eq!(resolved.noise_multiplier, expected);
    // The ledger of the run (found under the output's `operator/`) records the exact discrete
    // Gaussian that ran, whose sigma / sensitivity covers that z, and reports within the target.
    let v = json(&["ledger", out.to_str().unwrap(), "--json"]);
    let entries = v["entries"].as_array().unwrap();
    assert!(!entries.is_empty(), "{v}");
    for e in entries {
        let dg = &e["event"]["event"];
        assert_eq!(dg["kind"], "discrete_gaussian", "{e}");
        let z = f(&dg["sigma"]) / f(&dg["l2_sensitivity"]);
        assert!(
            z >= expected && z <= expected * (1.0 + 1e-9),
            "{z} vs {expected}: {e}"
        );
    }
    assert!(f(&v["epsilon"]) <= 8.0, "{v}");
}

/// Un-sampled discrete Gaussian rounds: the zCDP rho (exact for the discrete Gaussian) is shown
/// beside the epsilon, in JSON and in text; a sampled ledger shows none.
#[test]
fn zcdp_rho_is_shown_beside_the_epsilon_for_unsampled_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("privacy.ledger");
    let cfg = LedgerConfig {
        target_epsilon: 50.0,
        delta: 1e-5.try_into().unwrap(),
        unit_kind: UnitKind::User,
        participation: Participation::sampled(0.5).unwrap(),
    };
    let (mut l, _) = PrivacyLedger::open(&path, cfg).unwrap();
    // The default grid: Delta = 2^24 grid units, sigma = 1.5 Delta (z = 1.5).
    let delta = (1u64 << 24) as f64;
    for r in 1..=3 {
        l.append(RoundRecord {
            round: r,
            phase: "training".into(),
            event: DpEvent::DiscreteGaussian {
                sigma: 1.5 * delta,
                l2_sensitivity: delta,
            },
            sampled_by_aggregator: false,
            units: vec![1, 2],
            clip_norm: Some(1.0),
            expected_cohort: Some(2.0),
            noise_source: NoiseSource::Os,
            unix_time_s: 1.7e9,
        })
        .unwrap();
    }
    drop(l);
    let d = dir.path().to_str().unwrap();
    let v = json(&["ledger", d, "--json"]);
    // Three rounds of Delta^2 / (2 sigma^2) = 1 / 4.5.
    assert!((f(&v["zcdp_rho"]) - 3.0 / 4.5).abs() < 1e-12, "{v}");
    let (code, out, stderr) = fedrl(&["ledger", d]);
    assert_eq!(code, 0, "{stderr}");
    assert!(out.contains("zCDP rho      0.666667"), "{out}");

    let dir = tempfile::tempdir().unwrap();
    mixed_ledger(dir.path());
    let v = json(&["ledger", dir.path().to_str().unwrap(), "--json"]);
    assert!(v["zcdp_rho"].is_null(), "{v}");
}

/// Issue 59, item 7: `fedrl ledger DIR | head` (and `--json | head`) panicked on the closed pipe
/// (exit 101); a reader that stops early now ends the command quietly.
#[test]
fn a_closed_pipe_ends_the_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    mixed_ledger(dir.path());
    for json in [false, true] {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_fedrl"));
        cmd.args(["ledger", dir.path().to_str().unwrap(), "--all-units"]);
        if json {
            cmd.arg("--json");
        }
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes away before anything was written: every write meets a closed pipe.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "--json {json}: {stderr}");
        assert!(!stderr.contains("panicked"), "--json {json}: {stderr}");
    }
}

/// The frame ranges of a ledger file (`FRL1`: 16-byte header, `FRLC`: 48).
fn frames(bytes: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = if &bytes[at..at + 4] == b"FRLC" {
            48
        } else {
            16
        };
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
        out.push(at..at + header + len);
        at += header + len;
    }
    out
}

/// Issue 59, item 4: a record cut out of the ledger (whole frames) was read with exit 0 and a
/// smaller epsilon; now the chain says so. Cutting the last record is caught against the head
/// the operator's report recorded.
#[test]
fn removed_records_and_a_cut_tail_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = mixed_ledger(dir.path());
    let d = dir.path().to_str().unwrap();
    let good = std::fs::read(&path).unwrap();
    let fr = frames(&good);
    // The release record is the last; cut the second round record instead.
    let mut cut = good[..fr[2].start].to_vec();
    cut.extend_from_slice(&good[fr[2].end..]);
    std::fs::write(&path, &cut).unwrap();
    let (code, _, stderr) = fedrl(&["ledger", d]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("removed, reordered or inserted"),
        "{stderr}"
    );

    // The whole ledger back, its head recorded in the operator's report as a run leaves it.
    std::fs::write(&path, &good).unwrap();
    let head = PrivacyLedger::read_file(&path).unwrap().head();
    let op = dir.path().join("operator");
    std::fs::create_dir_all(&op).unwrap();
    let report = serde_json::json!({"epsilon": 1.0, "ledger_head": head});
    std::fs::write(op.join("report.json"), report.to_string()).unwrap();
    let v = json(&["ledger", d, "--json"]);
    assert_eq!(
        v["chain"]["heads_checked"].as_array().unwrap().len(),
        1,
        "{v}"
    );
    // The last record (the release) cut off: a valid chain, but short of the recorded head.
    std::fs::write(&path, &good[..fr[fr.len() - 1].start]).unwrap();
    let (code, out, stderr) = fedrl(&["ledger", d]);
    assert_ne!(code, 0, "{out}");
    assert!(
        stderr.contains("holds 5 entries, but 6 were recorded") && stderr.contains("report.json"),
        "{stderr}"
    );
}

/// A ledger of the last unchained format reads, and says it is unchained.
#[test]
fn an_unchained_ledger_says_so() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../common/tests/fixtures/ledger-v2.ledger");
    let (code, out, stderr) = fedrl(&["ledger", fixture.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(out.contains("format version 2"), "{out}");
    assert!(out.contains("UNCHAINED"), "{out}");
}
