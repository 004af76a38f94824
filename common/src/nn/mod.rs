//! Neural models (candle) and RL losses shared by the client agent and the aggregator.
