//! fedrl-client: the client agent. It hosts many simulated users, answers the aggregator's round
//! offers for the users it hosts, computes and clips each user's local update, and talks QUIC.
