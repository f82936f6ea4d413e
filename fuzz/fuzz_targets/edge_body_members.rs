//! Fuzz target `edge_body_members`: see [`iop_fuzz::edge_body_members`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::edge_body_members(data));
