//! Fuzz target `http_response_head`: see [`iop_fuzz::http_response_head`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::http_response_head(data));
