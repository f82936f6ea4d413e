//! Fuzz target `lease_open`: see [`iop_fuzz::lease_open`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::lease_open(data));
