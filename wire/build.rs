//! Generates the prost types from `proto/iop/runtime.proto` with the pure-Rust
//! `protox` compiler, so no system `protoc` is needed (X3: generated code is
//! written to `OUT_DIR`, never checked in or edited).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    let schema = proto_root.join("iop/runtime.proto");
    println!("cargo:rerun-if-changed={}", schema.display());

    let file_descriptors = protox::compile([&schema], [&proto_root])?;
    prost_build::Config::new()
        .bytes(["."])
        .compile_fds(file_descriptors)?;
    Ok(())
}
