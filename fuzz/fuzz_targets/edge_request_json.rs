//! Fuzz target `edge_request_json`: see [`iop_fuzz::edge_request_json`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::edge_request_json(data));
