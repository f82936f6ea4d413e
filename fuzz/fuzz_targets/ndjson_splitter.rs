//! Fuzz target `ndjson_splitter`: see [`iop_fuzz::ndjson_splitter`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::ndjson_splitter(data));
