//! Malicious clients against a real aggregator process over QUIC on 127.0.0.1.
//!
//! An honest `fedrl client` process hosts users 0..12; this test process plays the attackers:
//! garbage bytes, an oversized frame, a wrong token, an old protocol version and an update before
//! joining (each on its own connection, each must get a clear error), then an enrolled client
//! hosting users 12..17 that sends a vector of norm 1000 x C, a NaN vector, a wrong-length vector,
//! a valid vector and its duplicate, then an oversized update frame. The honest round must be
//! released, and the released model must be exactly what the honest (and the valid malicious)
//! clipped updates plus the seeded noise give, divided by the fixed cohort size.

mod e2e_support;

use std::time::Duration;

use e2e_support::*;
use fedrl_aggregator::checkpoint;
use fedrl_aggregator::engine::round_noise_seed;
use fedrl_common::privacy::fixed_point::noisy_mean;
use fedrl_common::privacy::ledger::PrivacyLedger;
use fedrl_common::privacy::noise::{DiscreteGaussianNoise, NoiseSource};
use fedrl_common::protocol::auth::parse_fingerprint;
use fedrl_common::protocol::{
    ErrorCode, Join, MAX_CONTROL_FRAME_BYTES, Message, PROTOCOL_VERSION, UnitRange, Update,
    decode_frame, encode_frame, encode_payload, frame_prefix,
};
use fedrl_common::scenario::{Scenario, Task};

const SCENARIO: &str = r#"
name = "malicious"
seed = 11
rounds = 1
users = 17
participation = { kind = "sampled", rate = 1.0 }
quorum = 10
round_deadline_s = 20.0
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

struct Peer {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
}

async fn connect(ep: &quinn::Endpoint, addr: &fedrl_aggregator::service::AddressFile) -> Peer {
    let fp = parse_fingerprint(&addr.fingerprint).unwrap();
    let cfg = fedrl_client::tls::client_config(fp).unwrap();
    let conn = ep
        .connect_with(cfg, addr.addr, "fedrl-aggregator")
        .unwrap()
        .await
        .unwrap();
    let (send, recv) = conn.open_bi().await.unwrap();
    Peer { conn, send, recv }
}

/// Reads control frames until an error arrives; falls back to the close reason.
async fn next_error(p: &mut Peer) -> (Option<ErrorCode>, String) {
    let fut = async {
        let mut buf = Vec::new();
        loop {
            let mut chunk = [0u8; 4096];
            match p.recv.read(&mut chunk).await {
                Ok(Some(n)) => buf.extend_from_slice(&chunk[..n]),
                _ => break,
            }
            while let Ok((f, used)) = decode_frame(&buf, MAX_CONTROL_FRAME_BYTES) {
                buf.drain(..used);
                if let Message::Error(e) = f.message {
                    return (Some(e.code), e.message);
                }
            }
        }
        let reason = p
            .conn
            .close_reason()
            .map(|r| r.to_string())
            .unwrap_or_default();
        (None, reason)
    };
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .expect("no answer within 20 s")
}

/// Collects every control message until the connection ends.
async fn drain(p: &mut Peer) -> Vec<Message> {
    let fut = async {
        let mut buf = Vec::new();
        let mut out = Vec::new();
        loop {
            let mut chunk = [0u8; 4096];
            match p.recv.read(&mut chunk).await {
                Ok(Some(n)) => buf.extend_from_slice(&chunk[..n]),
                _ => break,
            }
            while let Ok((f, used)) = decode_frame(&buf, MAX_CONTROL_FRAME_BYTES) {
                buf.drain(..used);
                out.push(f.message);
            }
        }
        out
    };
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .expect("connection did not end")
}

fn join_frame(token: &str, units: Vec<UnitRange>) -> Vec<u8> {
    encode_frame(
        &Message::Join(Join {
            token: token.into(),
            units,
            agent: "attacker".into(),
            instance: 1,
        }),
        &[],
    )
    .unwrap()
}

#[test]
fn malicious_clients_get_clear_errors_and_honest_rounds_complete_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let scenario_path = write(dir.path(), "s.toml", SCENARIO);
    let scenario = Scenario::from_toml_str(SCENARIO).unwrap();
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
        "0..12",
        &dir.path().join("honest.log"),
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (v12, v15) = rt.block_on(async {
        let ep = fedrl_client::tls::client_endpoint(addr.addr).unwrap();

        // Garbage bytes: a frame with a valid prefix and version but an undecodable header.
        let mut p = connect(&ep, &addr).await;
        let mut junk = 20u32.to_le_bytes().to_vec();
        junk.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        junk.extend_from_slice(&14u32.to_le_bytes());
        junk.extend_from_slice(&[0xff; 14]);
        p.send.write_all(&junk).await.unwrap();
        let (code, msg) = next_error(&mut p).await;
        assert_eq!(code, Some(ErrorCode::BadFrame), "{msg}");
        assert!(msg.contains("malformed"), "{msg}");

        // Garbage bytes: plain text (its first four bytes read as a huge length).
        let mut p = connect(&ep, &addr).await;
        p.send
            .write_all(b"GET / HTTP/1.1\r\nHost: fedrl\r\n\r\n")
            .await
            .unwrap();
        let (code, msg) = next_error(&mut p).await;
        assert_eq!(code, Some(ErrorCode::FrameTooLarge), "{msg}");

        // An oversized frame: refused from its length prefix alone.
        let mut p = connect(&ep, &addr).await;
        p.send
            .write_all(&(200u32 << 20).to_le_bytes())
            .await
            .unwrap();
        let (code, msg) = next_error(&mut p).await;
        assert_eq!(code, Some(ErrorCode::FrameTooLarge), "{msg}");
        assert!(msg.contains("exceeds the maximum"), "{msg}");

        // A wrong token (issued under another secret).
        let mut p = connect(&ep, &addr).await;
        let forged = fedrl_common::protocol::auth::issue_token(&[1u8; 32], "mallory").unwrap();
        p.send
            .write_all(&join_frame(&forged, vec![UnitRange { start: 12, end: 17 }]))
            .await
            .unwrap();
        let (code, msg) = next_error(&mut p).await;
        assert_eq!(code, Some(ErrorCode::AuthFailed), "{msg}");
        assert!(msg.contains("authentication failed"), "{msg}");

        // An old protocol version (a valid join otherwise).
        let mut p = connect(&ep, &addr).await;
        let mut old = join_frame(
            &token(&secret, "mal"),
            vec![UnitRange { start: 12, end: 17 }],
        );
        old[4] = 0;
        old[5] = 0;
        p.send.write_all(&old).await.unwrap();
        let (code, msg) = next_error(&mut p).await;
        assert_eq!(code, Some(ErrorCode::UnsupportedVersion), "{msg}");
        assert!(msg.contains("unsupported protocol version 0"), "{msg}");

        // An update before joining.
        let mut p = connect(&ep, &addr).await;
        let up = encode_frame(&Message::Update(Update { round: 1, unit: 12 }), &[0.0; 8]).unwrap();
        p.send.write_all(&up).await.unwrap();
        let (code, msg) = next_error(&mut p).await;
        assert_eq!(code, Some(ErrorCode::Unexpected), "{msg}");

        // The enrolled attacker: joins with users 12..17, which completes the population and
        // opens round 1.
        let mut p = connect(&ep, &addr).await;
        p.send
            .write_all(&join_frame(
                &token(&secret, "mal"),
                vec![UnitRange { start: 12, end: 17 }],
            ))
            .await
            .unwrap();
        let mut offer_stream = tokio::time::timeout(Duration::from_secs(30), p.conn.accept_uni())
            .await
            .unwrap()
            .unwrap();
        let bytes = offer_stream.read_to_end(1 << 20).await.unwrap();
        let (offer, _) = decode_frame(&bytes, 1 << 20).unwrap();
        let Message::RoundOffer(o) = offer.message else {
            panic!("expected an offer, got {:?}", offer.message)
        };
        assert_eq!(o.spec.round, 1);
        assert_eq!(o.units, vec![12, 13, 14, 15, 16]);
        assert_eq!(offer.payload, vec![0.0f32; 8]);

        let c = 1000.0 / 8f32.sqrt();
        let big: Vec<f32> = (0..8).map(|i| if i % 2 == 0 { c } else { -c }).collect();
        let mut nan = vec![0.1f32; 8];
        nan[3] = f32::NAN;
        let v15: Vec<f32> = vec![0.05, -0.1, 0.2, 0.0, 0.3, -0.25, 0.1, 0.05];
        let frame = |unit: u64, v: &[f32]| {
            encode_frame(&Message::Update(Update { round: 1, unit }), v).unwrap()
        };
        // One stream: the server reads it in order, so the replies come in order.
        let mut s = p.conn.open_uni().await.unwrap();
        s.write_all(&frame(12, &big)).await.unwrap();
        s.write_all(&frame(13, &nan)).await.unwrap();
        s.write_all(&frame(14, &[0.1; 7])).await.unwrap();
        s.write_all(&frame(15, &v15)).await.unwrap();
        s.write_all(&frame(15, &v15)).await.unwrap();
        // Unit 16 never answers; an oversized update frame ends the attacker's session.
        let mut oversized =
            frame_prefix(&Message::Update(Update { round: 1, unit: 16 }), 1 << 20).unwrap();
        oversized.extend(encode_payload(&[0.0; 16]));
        s.write_all(&oversized).await.unwrap();
        let _ = s.finish();

        let replies = drain(&mut p).await;
        let summary: Vec<String> = replies
            .iter()
            .map(|m| match m {
                Message::Ack(a) => format!("ack {} clipped={}", a.unit, a.clipped),
                Message::Error(e) => format!("error {:?} {:?}", e.code, e.unit),
                other => other.kind().to_string(),
            })
            .collect();
        assert_eq!(
            summary[1..],
            [
                "ack 12 clipped=true",
                "error NonFinite Some(13)",
                "error WrongLength Some(14)",
                "ack 15 clipped=false",
                "error DuplicateUnit Some(15)",
                "error FrameTooLarge None",
            ],
            "{replies:?}"
        );
        assert!(matches!(replies[0], Message::Welcome(_)));
        if let Some(Message::Ack(a)) = replies.get(1) {
            // The server measured the norm before clipping: 1000 x C.
            assert!((a.norm - 1000.0).abs() < 1e-2, "norm {}", a.norm);
        }
        ep.close(0u32.into(), b"");
        (big, v15)
    });

    let status = agg.wait(Duration::from_secs(60));
    assert!(status.success(), "aggregator failed:\n{}", agg.log_text());
    let status = honest.wait(Duration::from_secs(30));
    assert!(
        status.success(),
        "honest client failed:\n{}",
        honest.log_text()
    );

    // The round was released with the honest units plus the attacker's valid ones.
    let (_, records, _) =
        PrivacyLedger::read(state_dir.join(fedrl_aggregator::state::LEDGER_FILE)).unwrap();
    assert_eq!(records.len(), 1);
    let rec = &records[0];
    let mut expected_units: Vec<u64> = (0..13).collect();
    expected_units.push(15);
    assert_eq!(rec.units, expected_units);
    assert_eq!(rec.expected_cohort, Some(17.0));
    assert_eq!(rec.sampling_rate(), Some(1.0));
    let seed = round_noise_seed(11, 1);
    assert_eq!(rec.noise_source, NoiseSource::Seeded { seed });
    let report = report(&state_dir);
    assert_eq!(report["rounds_completed"], 1);
    assert_eq!(report["seeded"], true);

    // Recompute the release from scratch.
    let Task::MeanEstimation(task) = &scenario.task else {
        panic!("the scenario is mean estimation")
    };
    let mu = task.true_mean();
    // The engine's one noisy aggregation: re-clip to C = 1, fixed-point sum, exact discrete
    // Gaussian noise (z = 0.5) from the round's seed, over the fixed denominator 17.
    let mut updates: Vec<Vec<f32>> = (0..12).map(|u| task.user_vector(&mu, u)).collect();
    updates.push(v12);
    updates.push(v15);
    let expected = noisy_mean(
        updates.iter().map(|v| v.as_slice()),
        8,
        1.0,
        0.5,
        17.0,
        &mut DiscreteGaussianNoise::seeded(seed),
    )
    .unwrap()
    .mean;
    let (_, st) = checkpoint::load(&state_dir).unwrap().expect("checkpoint");
    let released = &st.tensors[..8];
    for (a, b) in released.iter().zip(&expected) {
        // Integer sums do not depend on the order of the additions: bit for bit.
        assert!(
            a.to_bits() == b.to_bits(),
            "released {released:?}\nexpected {expected:?}"
        );
    }
}
