//! Fuzz target `openai_stream`: see [`iop_fuzz::openai_stream`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::openai_stream(data));
