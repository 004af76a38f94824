"""fedrl's Gymnasium bridge: the Python side of `env = "gymnasium:<id>"` populations.

`worker` is the process the client agent starts (`python -m fedrl_bridge.worker`); `protocol`
is the wire format it speaks (its Rust twin: `simulators/src/gym_bridge/protocol.rs`);
`test_envs` registers small environments that the bridge's own tests use (one misbehaves on
purpose, one stands for a user's own environment).
"""
