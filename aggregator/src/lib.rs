//! fedrl-aggregator: the QUIC server, the sans-IO round engine, server-side clipping and noise,
//! the privacy ledger, central training and checkpoints.
