//! Architectural boundaries that the contract forbids crossing, checked on
//! the source so a regression fails the build's tests.
//!
//! X4 is checked on the module graph, not on a list of names: the *surface*
//! modules are found from the code (the modules that use the HTTP server
//! types), and the transport modules — the Edge's node-connection handler,
//! the engine's frame connection, every module of the Node's session — must
//! neither use those types nor reach into a surface module.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// What answers a client over HTTP: the server connection, the gateway error
/// shape, and the calls that write a response.
const SURFACE_TYPES: [&str; 6] = [
    "ServerConn",
    "GatewayError",
    "write_response",
    "write_error",
    "start_chunked",
    "sse_error_event",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Code lines only: comments say what the module does not do, which is not
/// a dependency.
fn code(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `.rs` file under `dir`, recursively, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The module a source file is (`src/x.rs` and `src/x/mod.rs` are `x`,
/// `src/x/y.rs` is `x::y`); the files under a module's `tests/` folder
/// count as that module.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if let Some(i) = parts.iter().position(|p| p == "tests") {
        parts.truncate(i);
    }
    parts.join("::")
}

/// Every module of the crate at `src`.
fn modules(src: &Path) -> BTreeSet<String> {
    rust_files(src).iter().map(|f| module_of(src, f)).collect()
}

/// The modules of `modules` that `text` refers to by path (`crate::x::y::Item`,
/// and `use crate::{x, y::z}` groups): each path is resolved to the longest
/// module it starts with.
fn crate_references(text: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let path = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
            .collect()
    };
    let mut resolve = |p: &str| {
        let segments: Vec<&str> = p.split("::").filter(|s| !s.is_empty()).collect();
        for n in (1..=segments.len()).rev() {
            let candidate = segments[..n].join("::");
            if modules.contains(&candidate) {
                out.insert(candidate);
                return;
            }
        }
    };
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                resolve(&path(item.trim()));
            }
        } else {
            resolve(&path(rest));
        }
    }
    out
}

/// The surface modules of the crate at `src`: those whose code uses one of
/// [`SURFACE_TYPES`].
fn surface_modules(src: &Path) -> BTreeSet<String> {
    rust_files(src)
        .iter()
        .filter(|f| {
            let text = code(&read(f));
            SURFACE_TYPES.iter().any(|t| text.contains(t))
        })
        .map(|f| module_of(src, f))
        .collect()
}

/// Asserts that transport source `file` uses no surface type and refers to
/// none of `surface` (the surface modules of its crate, whose modules are
/// `modules`).
fn assert_transport(file: &Path, surface: &BTreeSet<String>, modules: &BTreeSet<String>) {
    let text = code(&read(file));
    for t in SURFACE_TYPES {
        assert!(
            !text.contains(t),
            "{} (transport) uses the HTTP surface's `{t}`",
            file.display()
        );
    }
    let reached: Vec<_> = crate_references(&text, modules)
        .intersection(surface)
        .cloned()
        .collect();
    assert!(
        reached.is_empty(),
        "{} (transport) depends on surface module(s) {reached:?}",
        file.display()
    );
    assert!(
        !text.contains("HTTP/1."),
        "{} (transport) writes HTTP",
        file.display()
    );
}

// CONTRACT: X4 — transport handlers build no HTTP or console response:
// surface translation lives in the Edge's surface modules. The Edge's node
// handler, the engine's frame connection and every module of the Node's
// session use no HTTP server type and reach into no surface module.
#[test]
fn transport_modules_do_not_depend_on_the_http_surface() {
    let edge_src = root().join("edge-bin/src");
    let edge_modules = modules(&edge_src);
    let surface = surface_modules(&edge_src);
    // The check can fail: the surface is found, and it is what it should be.
    for expected in ["client::conn", "client::relay", "api::error", "api::openai"] {
        assert!(surface.contains(expected), "{surface:?}");
    }
    assert!(!surface.contains("link::nodes"), "{surface:?}");
    assert_transport(&edge_src.join("link/nodes.rs"), &surface, &edge_modules);

    for file in rust_files(&root().join("engine/src/conn")) {
        let text = code(&read(&file));
        assert!(
            !text.contains("crate::http") && !text.contains("super::http"),
            "{} depends on the HTTP layer",
            file.display()
        );
        assert_transport(&file, &BTreeSet::new(), &BTreeSet::new());
    }

    let node_src = root().join("node-bin/src");
    let node_modules = modules(&node_src);
    let node_surface = surface_modules(&node_src);
    assert!(
        node_surface.is_empty(),
        "the Node serves no HTTP: {node_surface:?}"
    );
    let session = rust_files(&node_src.join("session"));
    assert!(session.len() >= 2, "{session:?}");
    for file in &session {
        assert_transport(file, &node_surface, &node_modules);
    }
}

#[test]
fn references_are_read_from_paths_and_use_groups() {
    let modules: BTreeSet<String> = ["control", "link", "link::edge", "client::admin"]
        .into_iter()
        .map(String::from)
        .collect();
    let refs = crate_references(
        "use crate::{link::edge::Edge, control::Input};\nlet x = crate::client::admin::is_admin(1);\n\
         let y = crate::link::Unknown;",
        &modules,
    );
    assert_eq!(
        refs.into_iter().collect::<Vec<_>>(),
        ["client::admin", "control", "link", "link::edge"]
    );
}
