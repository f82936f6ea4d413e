//! Fuzz target `frame_decoder`: see [`iop_fuzz::frame_decoder`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::frame_decoder(data));
