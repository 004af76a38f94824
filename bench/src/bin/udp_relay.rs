//! A UDP relay that delays every datagram by a fixed time in each direction: QUIC between client
//! agents and the aggregator runs over it to emulate a link's latency where the kernel has no
//! `netem` (`bench/run_release_latency.sh` uses it for the DataRelease's wall-clock).
//!
//! `udp_relay --listen 127.0.0.1:7100 --upstream 127.0.0.1:7000 --delay-ms 20` forwards what
//! arrives on `--listen` to `--upstream` and the answers back, each datagram `--delay-ms` later
//! than it arrived (one socket per client address, so the aggregator sees one peer per client).
//! Order is kept per direction and peer: datagrams leave in the order they came, each at its own
//! arrival time plus the delay. Runs until killed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tokio::net::UdpSocket;
use tokio::sync::{Mutex, mpsc};
use tokio::time::Instant;

#[derive(Parser)]
struct Args {
    /// Where clients send their datagrams.
    #[arg(long)]
    listen: SocketAddr,
    /// Where they are forwarded (the aggregator).
    #[arg(long)]
    upstream: SocketAddr,
    /// Delay added to each datagram, each way (milliseconds).
    #[arg(long, default_value_t = 20.0)]
    delay_ms: f64,
}

/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_536;

/// A queue that sends each datagram `delay` after it was queued, in order.
fn delayed_sender(
    socket: Arc<UdpSocket>,
    to: Option<SocketAddr>,
    delay: Duration,
) -> mpsc::UnboundedSender<(Instant, Vec<u8>)> {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    tokio::spawn(async move {
        while let Some((arrived, data)) = rx.recv().await {
            tokio::time::sleep_until(arrived + delay).await;
            let sent = match to {
                Some(addr) => socket.send_to(&data, addr).await,
                None => socket.send(&data).await,
            };
            if let Err(e) = sent {
                eprintln!("udp_relay: send failed: {e}");
            }
        }
    });
    tx
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !(args.delay_ms.is_finite() && args.delay_ms >= 0.0) {
        anyhow::bail!("--delay-ms must be >= 0, got {}", args.delay_ms);
    }
    let delay = Duration::from_secs_f64(args.delay_ms / 1000.0);
    let front = Arc::new(
        UdpSocket::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?,
    );
    eprintln!(
        "udp_relay: {} -> {} with {} ms each way",
        front.local_addr()?,
        args.upstream,
        args.delay_ms
    );
    type Peers = HashMap<SocketAddr, mpsc::UnboundedSender<(Instant, Vec<u8>)>>;
    let peers: Arc<Mutex<Peers>> = Arc::new(Mutex::new(HashMap::new()));
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let (n, from) = front.recv_from(&mut buf).await?;
        let arrived = Instant::now();
        let mut map = peers.lock().await;
        let up = match map.get(&from) {
            Some(tx) => tx.clone(),
            None => {
                // A new client: its own upstream socket, and a task carrying the answers back.
                let bind: SocketAddr = if args.upstream.is_ipv4() {
                    "0.0.0.0:0".parse()?
                } else {
                    "[::]:0".parse()?
                };
                let sock = Arc::new(UdpSocket::bind(bind).await?);
                sock.connect(args.upstream).await?;
                let up = delayed_sender(sock.clone(), None, delay);
                let back = delayed_sender(front.clone(), Some(from), delay);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; MAX_DATAGRAM];
                    while let Ok(n) = sock.recv(&mut buf).await {
                        if back.send((Instant::now(), buf[..n].to_vec())).is_err() {
                            break;
                        }
                    }
                });
                map.insert(from, up.clone());
                up
            }
        };
        drop(map);
        if up.send((arrived, buf[..n].to_vec())).is_err() {
            peers.lock().await.remove(&from);
        }
    }
}
