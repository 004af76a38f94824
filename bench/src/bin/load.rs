//! QUIC load generator for the aggregator.
//!
//! `load --clients N --dim D [--rounds R] [--units-per-client K]` starts an aggregator in a child
//! process (this binary with `--serve`, so its peak RSS is its own), then N client agents in this
//! process, each hosting K users whose update is a fixed vector of D floats. Every round samples
//! every user (rate 1), so each round ingests N x K x D x 4 bytes. It prints updates/s, MB/s
//! ingested, rounds/s and the aggregator's peak RSS (VmHWM) as JSON.
//!
//! Rates are measured between the first and the last release (the steady state: handshakes and
//! the first model broadcast excluded); `overall_*` figures include everything.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use fedrl_aggregator::service::{AggregatorOptions, read_address_file, run};
use fedrl_aggregator::state;
use fedrl_client::{AgentOptions, LocalTrainer, TrainerFactory, run_agent};
use fedrl_common::protocol::auth::{issue_token, parse_fingerprint};
use fedrl_common::protocol::{RoundSpec, UnitId, UnitRange};

#[derive(Parser)]
struct Args {
    /// Client connections.
    #[arg(long, default_value_t = 256)]
    clients: u64,
    /// Floats per update.
    #[arg(long, default_value_t = 10_000)]
    dim: usize,
    /// Rounds.
    #[arg(long, default_value_t = 6)]
    rounds: u64,
    /// Users hosted by each client (updates per client per round).
    #[arg(long, default_value_t = 1)]
    units_per_client: u64,
    /// Update frames the aggregator reads concurrently.
    #[arg(long, default_value_t = 8)]
    inflight: usize,
    /// UDP payload size the clients and the aggregator start with / probe up to, bytes
    /// (loopback carries 65,507; quinn's default is 1,200 rising to 1,452). Above 6,500 GSO is
    /// turned off (a batch of 10 datagrams must fit in 64 KiB).
    #[arg(long, default_value_t = 6_400)]
    mtu: u16,
    /// Aggregator per-stream receive window, KiB.
    #[arg(long, default_value_t = 1024)]
    stream_window_kib: u32,
    /// Aggregator receive window of a connection whose body is being read, KiB.
    #[arg(long, default_value_t = 2048)]
    conn_window_kib: u32,
    /// Internal: run the aggregator for SCENARIO in STATE_DIR.
    #[arg(long, num_args = 2, value_names = ["SCENARIO", "STATE_DIR"])]
    serve: Option<Vec<PathBuf>>,
}

fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// CPU seconds (user + system) this process used so far, from `/proc/self/stat`.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        f.get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    // utime and stime are fields 14 and 15 of the line: indices 11 and 12 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

fn serve(scenario: &Path, state_dir: &Path, args: &Args) -> anyhow::Result<()> {
    let s = fedrl_tasks::scenario_from_file(scenario)?;
    let model = fedrl_tasks::server_model(&s)?;
    let mut opts = AggregatorOptions::new(s, "127.0.0.1:0".parse()?, state_dir.to_path_buf());
    opts.max_inflight_updates = args.inflight;
    opts.tuning.stream_receive_window = args.stream_window_kib << 10;
    opts.tuning.receive_window = args.conn_window_kib << 10;
    opts.send_udp_payload = args.mtu;
    // Every client of this benchmark is honest and connects from 127.0.0.1 at once: the caps
    // against unauthenticated floods (64 per address) would only make them retry.
    let cap = args.clients as usize + 64;
    opts.max_connections = opts.max_connections.max(cap);
    opts.max_unauthenticated = opts.max_unauthenticated.max(cap);
    opts.max_unauthenticated_per_address = opts.max_unauthenticated_per_address.max(cap);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(run(opts, model, None))?;
    let out = serde_json::json!({
        "report": report,
        "peak_rss_kb": peak_rss_kb(),
        "cpu_s": cpu_seconds(),
    });
    std::fs::write(state_dir.join("serve.json"), serde_json::to_vec(&out)?)?;
    Ok(())
}

/// A client endpoint that accepts datagrams as large as the aggregator sends on loopback, with
/// 4 MiB socket buffers (default buffers drop bursts).
fn client_endpoint() -> anyhow::Result<quinn::Endpoint> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let state = quinn::udp::UdpSocketState::new((&socket).into())?;
    let _ = state.set_recv_buffer_size((&socket).into(), 4 << 20);
    let _ = state.set_send_buffer_size((&socket).into(), 4 << 20);
    let mut cfg = quinn::EndpointConfig::default();
    cfg.max_udp_payload_size(65_527)?;
    let runtime = quinn::default_runtime().context("no async runtime")?;
    Ok(quinn::Endpoint::new(cfg, None, socket, runtime)?)
}

/// The client transport: the agent's keep-alive and idle timeout, large datagrams from the
/// start (loopback has no smaller MTU to discover).
fn client_transport(mtu: u16) -> anyhow::Result<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    let mut discovery = quinn::MtuDiscoveryConfig::default();
    discovery.upper_bound(mtu);
    t.keep_alive_interval(Some(Duration::from_secs(1)))
        .max_idle_timeout(Some(quinn::IdleTimeout::try_from(Duration::from_secs(8))?))
        .initial_mtu(mtu)
        .mtu_discovery_config(Some(discovery))
        .enable_segmentation_offload(mtu <= 6_500);
    Ok(t)
}

/// Every unit sends the same precomputed vector (the generator must not be the bottleneck).
struct Const(Arc<Vec<f32>>);

impl LocalTrainer for Const {
    fn local_updates(
        &mut self,
        _r: &RoundSpec,
        _g: &[f32],
        units: &[UnitId],
    ) -> Vec<(UnitId, Vec<f32>)> {
        units
            .iter()
            .map(|u| (*u, self.0.as_ref().clone()))
            .collect()
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(v) = &args.serve {
        return serve(&v[0], &v[1], &args);
    }
    let dir = tempfile::tempdir()?;
    let users = args.clients * args.units_per_client;
    let scenario = format!(
        r#"
name = "load"
seed = 1
rounds = {rounds}
users = {users}
participation = {{ kind = "sampled", rate = 1.0 }}
quorum = {users}
round_deadline_s = 600.0
start_timeout_s = 600.0
clip_norm = 1.0
noise_multiplier = 1.0
target_epsilon = 1e12
checkpoint_every = 1000000
max_frame_bytes = {max_frame}

[task]
kind = "mean_estimation"
dim = {dim}
"#,
        rounds = args.rounds,
        dim = args.dim,
        max_frame = args.dim as u64 * 4 + (1 << 16),
    );
    let scenario_path = dir.path().join("load.toml");
    std::fs::write(&scenario_path, scenario)?;
    let state_dir = dir.path().join("state");
    std::fs::create_dir_all(&state_dir)?;
    let secret = vec![7u8; 32];
    state::store_secret(&state_dir, &secret)?;
    // Measurement helper: `LOAD_SERVE_WRAPPER="heaptrack -o /tmp/agg"` runs the aggregator
    // under a profiler (the wrapper's words, then this binary and its arguments).
    let wrapper = std::env::var("LOAD_SERVE_WRAPPER").unwrap_or_default();
    let mut words = wrapper.split_whitespace();
    let mut child = match words.next() {
        Some(program) => {
            let mut c = Command::new(program);
            c.args(words).arg(std::env::current_exe()?);
            c
        }
        None => Command::new(std::env::current_exe()?),
    };
    let mut child = child
        .arg("--inflight")
        .arg(args.inflight.to_string())
        .arg("--stream-window-kib")
        .arg(args.stream_window_kib.to_string())
        .arg("--conn-window-kib")
        .arg(args.conn_window_kib.to_string())
        .arg("--mtu")
        .arg(args.mtu.to_string())
        .arg("--serve")
        .arg(&scenario_path)
        .arg(&state_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()?;
    let addr = loop {
        if let Ok(a) = read_address_file(&state_dir) {
            break a;
        }
        if let Some(s) = child.try_wait()? {
            bail!("aggregator exited: {s}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let fp = parse_fingerprint(&addr.fingerprint)?;
    let t0 = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let vector: Arc<Vec<f32>> = Arc::new(
        (0..args.dim)
            .map(|i| ((i % 7) as f32 - 3.0) * 1e-4)
            .collect(),
    );
    let results = rt.block_on(async {
        let limit = Arc::new(tokio::sync::Semaphore::new(64));
        // A few client endpoints (UDP sockets) shared by many connections.
        let endpoints: Vec<quinn::Endpoint> = (0..4)
            .map(|_| client_endpoint())
            .collect::<Result<_, _>>()?;
        let transport = Arc::new(client_transport(args.mtu)?);
        let mut set = tokio::task::JoinSet::new();
        for i in 0..args.clients {
            let mut o = AgentOptions::new(
                addr.addr,
                fp,
                issue_token(&secret, &format!("load-{i}"))?,
                vec![UnitRange {
                    start: i * args.units_per_client,
                    end: (i + 1) * args.units_per_client,
                }],
            );
            o.endpoint = Some(endpoints[i as usize % endpoints.len()].clone());
            o.handshake_limit = Some(limit.clone());
            o.churn_override = Some(Default::default());
            o.give_up_after_s = 120.0;
            o.transport = Some(transport.clone());
            let v = vector.clone();
            let factory: TrainerFactory =
                Arc::new(move |_, _| Ok(Box::new(Const(v.clone())) as Box<dyn LocalTrainer>));
            set.spawn(run_agent(o, factory));
        }
        let mut ok = 0;
        while let Some(r) = set.join_next().await {
            if matches!(r, Ok(Ok(_))) {
                ok += 1;
            }
        }
        anyhow::Ok(ok)
    })?;
    let status = child.wait()?;
    if !status.success() {
        bail!("aggregator failed: {status}");
    }
    let wall = t0.elapsed().as_secs_f64();
    let serve: serde_json::Value = serde_json::from_slice(
        &std::fs::read(state_dir.join("serve.json")).context("serve.json")?,
    )?;
    let metrics: Vec<serde_json::Value> =
        std::fs::read_to_string(state_dir.join(state::METRICS_FILE))?
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
    let times: Vec<f64> = metrics
        .iter()
        .filter(|m| m["status"] == "released")
        .filter_map(|m| m["t_s"].as_f64())
        .collect();
    let per_round_updates = users as f64;
    let update_bytes = args.dim as f64 * 4.0;
    let (steady_rounds, steady_s) = match (times.first(), times.last()) {
        (Some(a), Some(b)) if times.len() >= 2 => ((times.len() - 1) as f64, b - a),
        _ => (0.0, f64::NAN),
    };
    let rounds_per_s = steady_rounds / steady_s;
    let updates_per_s = rounds_per_s * per_round_updates;
    let mb_per_s = updates_per_s * update_bytes / 1e6;
    let report = &serve["report"];
    let gb = report["bytes_ingested"].as_f64().unwrap_or(0.0) / 1e9;
    let server_cpu = serve["cpu_s"].as_f64().unwrap_or(f64::NAN);
    let client_cpu = cpu_seconds();
    let load_avg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let out = serde_json::json!({
        "clients": args.clients,
        "units_per_client": args.units_per_client,
        "dim": args.dim,
        "rounds": args.rounds,
        "rounds_completed": report["rounds_completed"],
        "agents_ok": results,
        "updates_per_s": updates_per_s,
        "mb_per_s_ingested": mb_per_s,
        "rounds_per_s": rounds_per_s,
        "aggregator_peak_rss_mb": serve["peak_rss_kb"].as_f64().unwrap_or(0.0) / 1024.0,
        // Pooled update buffers (4 x dim bytes each): bounded by the read permits, not by N.
        "update_buffers_allocated": report["update_buffers_allocated"],
        "overall_mb_per_s": report["bytes_ingested"].as_f64().unwrap_or(0.0) / 1e6 / wall,
        "wall_seconds": wall,
        // CPU per GB ingested does not depend on what else runs on the machine (wall-clock
        // rates do): the aggregator's own, and the load generator's (clients) for comparison.
        "aggregator_cpu_s_per_gb": server_cpu / gb,
        "clients_cpu_s_per_gb": client_cpu / gb,
        "loadavg_after": load_avg.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
