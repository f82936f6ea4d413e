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
        // Boxed in `Frame`: every chunk is a `Frame` through the decoder
        // and the link's event queue, and then a pointer on its way to its
        // client (through the route's mailbox, which holds a window of
        // them): one allocation per chunk instead of copying ~270 bytes at
        // each hop and queueing them inline. The requests (sent once per
        // run) and the control messages are boxed so that a `Frame` is as
        // small as its small messages.
        .boxed(".iop.runtime.Frame.body.provider_tunnel_frame")
        .boxed(".iop.runtime.Frame.body.run_event")
        .boxed(".iop.runtime.Frame.body.provider_tunnel_request")
        .boxed(".iop.runtime.Frame.body.run_request")
        .boxed(".iop.runtime.Frame.body.node_command_response")
        .boxed(".iop.runtime.Frame.body.register_response")
        .boxed(".iop.runtime.Frame.body.node_config_refresh_request")
        // A tunnel frame (one per relayed chunk on each side) never carries
        // metadata in practice: an empty `BTreeMap` is built and dropped
        // for nothing, where a `HashMap` seeds a hasher each time.
        .btree_map([".iop.runtime.ProviderTunnelFrame.metadata"])
        .compile_fds(file_descriptors)?;
    Ok(())
}
