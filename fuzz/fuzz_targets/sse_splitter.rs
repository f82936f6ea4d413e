//! Fuzz target `sse_splitter`: see [`iop_fuzz::sse_splitter`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::sse_splitter(data));
