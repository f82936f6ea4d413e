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
        // Set on a run's terminal only: boxed, so the per-chunk frames the
        // relays move and queue carry 8 bytes for each instead of 160 and 32.
        .boxed(".iop.runtime.RunEvent.failure")
        .boxed(".iop.runtime.ProviderTunnelFrame.failure")
        .boxed(".iop.runtime.RunEvent.usage")
        .boxed(".iop.runtime.ProviderTunnelFrame.usage")
        // Sent once per run: boxed, so a `Frame` (which every chunk is,
        // through the decoder, the link's event queue and the encoder) is
        // the size of the per-chunk messages, not of the largest request.
        .boxed(".iop.runtime.Frame.body.provider_tunnel_request")
        .boxed(".iop.runtime.Frame.body.run_request")
        .compile_fds(file_descriptors)?;
    Ok(())
}
