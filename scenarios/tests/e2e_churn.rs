//! 30% churn: at least 95% of rounds reach quorum, and the reported epsilon equals the epsilon of
//! the same released rounds without churn.

mod e2e_support;

use std::time::Duration;

use e2e_support::*;
use fedrl_common::privacy::ledger::{PrivacyLedger, RoundRecord};
use fedrl_common::scenario::Scenario;

fn scenario(churn: &str) -> String {
    format!(
        r#"
name = "e2e-churn"
seed = 9
rounds = 20
users = 60
participation = {{ kind = "sampled", rate = 0.4 }}
quorum = 10
round_deadline_s = 0.6
clip_norm = 1.0
noise_multiplier = 1.5
target_epsilon = 1000.0
checkpoint_every = 5
{churn}

[task]
kind = "mean_estimation"
dim = 16
"#
    )
}

fn run(dir: &std::path::Path, text: &str) -> (serde_json::Value, Vec<RoundRecord>) {
    std::fs::create_dir_all(dir).unwrap();
    let path = write(dir, "s.toml", text);
    let state_dir = dir.join("state");
    let secret = prepare_state(&state_dir);
    let (mut agg, addr) = aggregator(&path, &state_dir, "127.0.0.1:0", &dir.join("agg.log"));
    let mut clients: Vec<Proc> = (0..3)
        .map(|i| {
            let users = format!("{}..{}", i * 20, (i + 1) * 20);
            client(
                &format!("c{i}"),
                &addr,
                &token(&secret, &format!("c{i}")),
                &users,
                &dir.join(format!("c{i}.log")),
            )
        })
        .collect();
    assert!(
        agg.wait(Duration::from_secs(120)).success(),
        "{}",
        agg.log_text()
    );
    for c in clients.iter_mut() {
        assert!(
            c.wait(Duration::from_secs(30)).success(),
            "{}",
            c.log_text()
        );
    }
    let (_, records, _) =
        PrivacyLedger::read(state_dir.join(fedrl_aggregator::state::LEDGER_FILE)).unwrap();
    (report(&state_dir), records)
}

#[test]
fn thirty_percent_churn_keeps_quorum_and_accounting() {
    let dir = tempfile::tempdir().unwrap();
    // 25% of units drop before uploading, 5% of offers end in a disconnect mid-upload (half of
    // that agent's units lost), plus up to 50 ms of added latency: about 30% of updates lost.
    let churn = "[churn]\ndrop_before_upload = 0.25\ndisconnect_mid_upload = 0.05\nadded_latency_s = 0.05\n";
    let (rep, records) = run(&dir.path().join("churn"), &scenario(churn));
    let completed = rep["rounds_completed"].as_u64().unwrap();
    let abandoned = rep["rounds_abandoned"].as_u64().unwrap();
    assert_eq!(completed + abandoned, 20, "{rep}");
    assert!(
        completed >= 19,
        "only {completed} of 20 rounds reached quorum: {rep}"
    );
    assert_eq!(records.len() as u64, completed);
    // Churn really happened: fewer units per round than sampled on average.
    let mean_units =
        records.iter().map(|r| r.units.len()).sum::<usize>() as f64 / records.len() as f64;
    assert!(
        mean_units < 0.4 * 60.0 * 0.9,
        "mean contributors {mean_units}"
    );

    // Without churn, the same number of released rounds costs the same epsilon: the accounting
    // depends on the mechanism and the released rounds, not on who dropped out.
    let (rep0, records0) = run(&dir.path().join("calm"), &scenario(""));
    assert_eq!(rep0["rounds_completed"], 20, "{rep0}");
    let s = Scenario::from_toml_str(&scenario("")).unwrap();
    let path = dir.path().join("same-rounds-ledger");
    let (mut l, _) = PrivacyLedger::open(&path, s.ledger_config().unwrap()).unwrap();
    for r in records0.iter().take(records.len()) {
        l.append(r.clone()).unwrap();
    }
    let eps_calm = l.report().unwrap().epsilon;
    let eps_churn = rep["epsilon"].as_f64().unwrap();
    assert!(
        (eps_calm - eps_churn).abs() <= 1e-9 * eps_calm.max(1.0),
        "churn {eps_churn} vs calm {eps_calm}"
    );
}
