//! Fuzz target `http_request_head`: see [`iop_fuzz::http_request_head`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::http_request_head(data));
