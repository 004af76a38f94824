//! `give_up_after_s` is a bound that cuts every wait, not a check made between whole session
//! attempts: an agent pointed at an address where no aggregator answers gives up with
//! [`AgentError::GaveUp`] whose last error is its handshake cut at the give-up limit, not the
//! end of a whole session attempt (a 10 s handshake timeout, an 8 s idle timeout) followed by a
//! backoff sleep. What is checked is that behaviour (the reason, and that it never gives up
//! before its limit), not how fast the machine ran it.

use std::sync::Arc;
use std::time::Duration;

use fedrl_client::{AgentError, AgentOptions, TrainerFactory, run_agent};
use fedrl_common::protocol::UnitRange;

#[test]
fn an_agent_gives_up_at_its_limit_by_cutting_the_handshake() {
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
    let limit = 2.0;
    opts.give_up_after_s = limit;
    let factory: TrainerFactory = Arc::new(|_, _| anyhow::bail!("never joins"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // A guard against a hang only (an agent that never gives up), not a measurement.
    let r = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(120), run_agent(opts, factory)).await
    });
    let r = r.expect("the agent never gave up");
    match r {
        Err(AgentError::GaveUp { secs, last }) => {
            // The handshake was cut by the give-up limit: without the cut, the last error would
            // be the handshake's own timeout.
            assert!(
                last.contains("at the give-up limit"),
                "the last error should be the handshake cut at the limit, got {last:?}"
            );
            // It counts from its start and gives up only once the limit has passed.
            assert!(
                secs >= limit,
                "gave up after {secs} s, before its {limit} s limit"
            );
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
}
