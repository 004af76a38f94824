//! Fuzzes the wire frame decoder: arbitrary bytes must decode or fail cleanly, never panic,
//! never allocate past the maximum frame size, and a decoded frame must re-encode to bytes that
//! decode to the same frame.
#![no_main]

use fedrl_common::protocol::{decode_frame, encode_frame};
use libfuzzer_sys::fuzz_target;

/// A small maximum, so the fuzzer explores the size check as well as the decoder.
const MAX: u64 = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    // A stream may hold several frames back to back.
    while let Ok((frame, used)) = decode_frame(rest, MAX) {
        assert!(used as u64 <= MAX && used <= rest.len());
        // Compare encodings, not values: NaN (in payloads or in f64 header fields) is not equal
        // to itself, but it must survive a round trip bit for bit.
        let bytes = encode_frame(&frame.message, &frame.payload).expect("re-encode");
        let (again, _) = decode_frame(&bytes, u64::MAX).expect("re-decode");
        let bytes2 = encode_frame(&again.message, &again.payload).expect("re-encode twice");
        assert_eq!(bytes, bytes2);
        rest = &rest[used..];
    }
});
