//! `give_up_after_s` is a bound in seconds, waits included: an agent pointed at an address where
//! no aggregator answers gives up within the limit (plus scheduling slack), not after its first
//! whole session attempt (a 10 s handshake timeout, an 8 s idle timeout) and a backoff sleep.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fedrl_client::{AgentError, AgentOptions, TrainerFactory, run_agent};
use fedrl_common::protocol::UnitRange;

#[test]
fn an_agent_gives_up_within_its_limit_in_seconds() {
    // A bound UDP socket that never reads: the agent's handshake packets go nowhere (no ICMP
    // error either), as with an aggregator host that drops them.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let server = silent.local_addr().unwrap();
    let mut opts = AgentOptions::new(
        server,
        [7; 32],
        "nobody.00".into(),
        vec![UnitRange { start: 0, end: 1 }],
    );
    opts.give_up_after_s = 3.0;
    let factory: TrainerFactory = Arc::new(|_, _| anyhow::bail!("never joins"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let t0 = Instant::now();
    let r = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(30), run_agent(opts, factory)).await
    });
    let took = t0.elapsed();
    let r = r.expect("the agent did not give up within 30 s");
    match r {
        Err(AgentError::GaveUp { secs, last }) => {
            assert!(
                (2.9..3.6).contains(&secs),
                "reported {secs} s for a 3 s limit (last error: {last})"
            );
            assert!(!last.is_empty());
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
    assert!(
        took >= Duration::from_secs_f64(2.9) && took < Duration::from_secs_f64(4.5),
        "gave up after {took:?} with a 3 s limit"
    );
}
