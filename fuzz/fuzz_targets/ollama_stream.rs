//! Fuzz target `ollama_stream`: see [`iop_fuzz::ollama_stream`] for the input layout and what
//! is checked.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iop_fuzz::ollama_stream(data));
