//! Versioned wire messages and the single codec (bincode 2 header + raw little-endian f32 payloads).
