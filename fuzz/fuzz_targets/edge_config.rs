//! Fuzz target `edge_config`: see [`iop_fuzz::edge_config`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::edge_config(data));
