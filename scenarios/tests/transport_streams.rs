//! A greedy client against a real aggregator process over QUIC on 127.0.0.1.
//!
//! An honest `fedrl client` process hosts users 4..12; this test process plays a greedy client
//! hosting users 0..4 that, once offered a round, opens 32 update streams at once and on each
//! announces a large update body, sends a few bytes of it and stalls. Before the aggregator
//! limited clients to one update stream per connection, every stalled stream took one of the
//! aggregator's 8 read permits, so honest updates waited past the round deadline and rounds were
//! abandoned. Now the greedy client gets one stream (the others wait for stream credit), holds at
//! most one permit, and every round is released with the honest users' updates.

mod e2e_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use e2e_support::*;
use fedrl_common::privacy::ledger::PrivacyLedger;
use fedrl_common::protocol::auth::parse_fingerprint;
use fedrl_common::protocol::quic_io::read_frame;
use fedrl_common::protocol::{Join, Message, UnitRange, Update, encode_frame, frame_prefix};

const SCENARIO: &str = r#"
name = "greedy-streams"
seed = 3
rounds = 3
users = 12
participation = { kind = "sampled", rate = 1.0 }
quorum = 8
round_deadline_s = 4.0
start_timeout_s = 60.0
clip_norm = 1.0
noise_multiplier = 0.5
delta = 1e-5
target_epsilon = 1000.0
checkpoint_every = 1
max_frame_bytes = 65536

[task]
kind = "mean_estimation"
dim = 8
mean_norm = 0.5
user_std = 0.1
data_seed = 5
"#;

/// Streams the greedy client tries to open at once.
const GREEDY_STREAMS: usize = 32;

#[test]
fn a_client_opening_many_streams_gets_one_and_honest_rounds_complete() {
    let dir = tempfile::tempdir().unwrap();
    let scenario_path = write(dir.path(), "s.toml", SCENARIO);
    let state_dir = dir.path().join("state");
    let secret = prepare_state(&state_dir);
    let (mut agg, addr) = aggregator(
        &scenario_path,
        &state_dir,
        "127.0.0.1:0",
        &dir.path().join("agg.log"),
    );
    let mut honest = client(
        "honest",
        &addr,
        &token(&secret, "honest"),
        "4..12",
        &dir.path().join("honest.log"),
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let opened = rt.block_on(async {
        let ep = fedrl_client::tls::client_endpoint(addr.addr).unwrap();
        let fp = parse_fingerprint(&addr.fingerprint).unwrap();
        let cfg = fedrl_client::tls::client_config(fp).unwrap();
        let conn = ep
            .connect_with(cfg, addr.addr, "fedrl-aggregator")
            .unwrap()
            .await
            .unwrap();
        let (mut send, _recv) = conn.open_bi().await.unwrap();
        let join = Message::Join(Join {
            token: token(&secret, "greedy"),
            units: vec![UnitRange { start: 0, end: 4 }],
            agent: "greedy".into(),
            instance: 1,
        });
        send.write_all(&encode_frame(&join, &[]).unwrap())
            .await
            .unwrap();
        // The join completes the population: round 1 is offered.
        let mut offer = tokio::time::timeout(Duration::from_secs(30), conn.accept_uni())
            .await
            .expect("no offer within 30 s")
            .unwrap();
        let frame = read_frame(&mut offer, 1 << 20, Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap();
        let Message::RoundOffer(o) = frame.message else {
            panic!("expected an offer, got {:?}", frame.message)
        };
        assert_eq!(o.units, vec![0, 1, 2, 3]);

        // Every stream announces a 60,000-byte update, sends 100 bytes of it and stalls; the
        // streams are kept open until the end of the run.
        let opened = Arc::new(AtomicUsize::new(0));
        let (keep_tx, mut keep_rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..GREEDY_STREAMS {
            let conn = conn.clone();
            let opened = opened.clone();
            let keep = keep_tx.clone();
            let round = o.spec.round;
            tokio::spawn(async move {
                let Ok(mut s) = conn.open_uni().await else {
                    return;
                };
                opened.fetch_add(1, Ordering::SeqCst);
                let msg = Message::Update(Update {
                    round,
                    unit: (i % 4) as u64,
                });
                let mut bytes = frame_prefix(&msg, 60_000 - 64).unwrap();
                bytes.extend_from_slice(&[0u8; 100]);
                let _ = s.write_all(&bytes).await;
                let _ = keep.send(s);
            });
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let opened_now = opened.load(Ordering::SeqCst);
        // Hold the streams (and the connection) until the aggregator ends the run.
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Some(s) = keep_rx.recv().await {
                held.push(s);
            }
        });
        let _ = tokio::time::timeout(Duration::from_secs(60), conn.closed()).await;
        ep.close(0u32.into(), b"");
        opened_now
    });
    assert_eq!(
        opened, 1,
        "a client must get exactly one update stream at a time, it opened {opened}"
    );

    let status = agg.wait(Duration::from_secs(60));
    assert!(status.success(), "aggregator failed:\n{}", agg.log_text());
    let status = honest.wait(Duration::from_secs(30));
    assert!(
        status.success(),
        "honest client failed:\n{}",
        honest.log_text()
    );
    let report = report(&state_dir);
    assert_eq!(report["rounds_completed"], 3, "{report}");
    assert_eq!(report["rounds_abandoned"], 0, "{report}");
    let (_, records, _) =
        PrivacyLedger::read(state_dir.join(fedrl_aggregator::state::LEDGER_FILE)).unwrap();
    assert_eq!(records.len(), 3);
    for rec in &records {
        let honest_units: Vec<u64> = (4..12).collect();
        assert_eq!(rec.units, honest_units, "round {}", rec.round);
    }
}
