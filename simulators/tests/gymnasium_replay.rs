//! Every Gymnasium 1.4.0 reference trace replays within tolerance, and `reset(seed)` draws the
//! same initial state as Gymnasium.

use fedrl_sim::replay::{replay_file, replay_gymnasium};
use serde_json::Value;

const TRACES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/gymnasium_traces.json"
);

fn traces() -> Value {
    let text = std::fs::read_to_string(TRACES).expect("read gymnasium traces");
    serde_json::from_str(&text).expect("parse gymnasium traces")
}

#[test]
fn every_gymnasium_trace_replays() {
    let results = replay_file(TRACES).expect("replay");
    assert_eq!(results.len(), 4);
    for r in &results {
        println!("{r:?}");
        assert!(r.pass, "{} did not replay: {r:?}", r.name);
        assert_eq!(r.mismatched_flags, 0, "{}", r.name);
        assert_eq!(r.max_reward_error, 0.0, "{}", r.name);
        assert!(r.steps > 0);
    }
}

#[test]
fn reset_seed_draws_gymnasiums_initial_state() {
    let trace = traces();
    for (id, episodes) in trace["envs"].as_object().expect("envs") {
        let mut env = fedrl_sim::make(id).expect("make");
        let mut obs = vec![0f32; env.observation_space().dim()];
        for ep in episodes.as_array().expect("episodes") {
            let seed: u64 = match &ep["seed"] {
                Value::String(s) => s.parse().expect("seed"),
                v => v.as_u64().expect("seed"),
            };
            env.reset(seed, &mut obs);
            let want: Vec<f64> = ep["initial_state"]
                .as_array()
                .expect("initial_state")
                .iter()
                .map(|x| x.as_f64().expect("number"))
                .collect();
            let got = env.state();
            assert_eq!(&got[..want.len()], &want[..], "{id} seed {seed}");
            let want_obs: Vec<f32> = ep["initial_obs"]
                .as_array()
                .expect("initial_obs")
                .iter()
                .map(|x| x.as_f64().expect("number") as f32)
                .collect();
            assert_eq!(obs, want_obs, "{id} seed {seed}");
        }
    }
}

#[test]
fn only_known_envs_are_in_the_trace_file() {
    // A trace with an unknown id is an error, not a silent pass.
    let bad: Value = serde_json::json!({
        "meta": {"source": "gymnasium 1.4.0"},
        "envs": {"NoSuchEnv-v0": []}
    });
    assert!(replay_gymnasium(&bad).is_err());
}
