//! Architectural boundaries that the contract forbids crossing, checked on
//! the source so a regression fails the build's tests.

use std::path::Path;

fn source(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Code lines only: comments say what the module does not do, which is not
/// a dependency.
fn code(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

// CONTRACT: X4 — the transport handler for node connections builds no HTTP
// or console response: surface translation lives in the surface modules.
#[test]
fn node_transport_handler_builds_no_http_response() {
    let nodes = code(&source("src/nodes.rs"));
    for forbidden in [
        "openai::",
        "ApiError",
        "ServerConn",
        "translate::",
        "write_response",
        "start_chunked",
        "sse_error_event",
        "HTTP/1.1",
    ] {
        assert!(
            !nodes.contains(forbidden),
            "src/nodes.rs (a transport handler) uses `{forbidden}`"
        );
    }
    // And the frame connection in the engine knows nothing of HTTP.
    let engine_conn = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/src/conn");
    for entry in std::fs::read_dir(&engine_conn).unwrap() {
        let path = entry.unwrap().path();
        let text = code(&std::fs::read_to_string(&path).unwrap());
        assert!(
            !text.contains("crate::http") && !text.contains("super::http"),
            "{} depends on the HTTP layer",
            path.display()
        );
    }
    // The check can fail: the surface module does build responses.
    assert!(code(&source("src/surface.rs")).contains("write_response"));
}
