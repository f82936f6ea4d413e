//! The cluster's fleet in etcd, every part a real process on loopback: one
//! `etcd`, two `edge-bin`s of one cluster (`edge-1` = A, `edge-2` = B),
//! one `bench mock-provider`, and `node-a` connected to A. Both Edges
//! start with the same fleet: `node-a` and `node-b` (never connected),
//! `model-a` on `node-a`, `model-b` on `node-b`.
//!
//! - at start the first Edge to find no fleet in etcd publishes its file's
//!   and the other adopts it: one fleet revision on both;
//! - a SIGHUP at A that adds a model publishes the fleet: B lists and
//!   serves the model without a reload of its own, both at the same fleet
//!   revision; B restarted with its old file applies the published fleet;
//! - a fleet that does not validate with B's own file (a client key of
//!   B's allowed only a model the fleet removes) is refused at B and
//!   counted, B keeps serving its running fleet, A serves the new one; once
//!   B's file no longer conflicts, B's next reload applies it, and B's
//!   stale fleet sections are never published.
//!
//! The processes are the cluster harness (`common/cluster.rs`). Build the
//! binaries first: `cargo build -p edge-bin -p node-bin -p bench --bins`.

use std::net::SocketAddr;
use std::time::Duration;

use iop_engine::clock;
use serde_json::{json, Value};

#[path = "common/cluster.rs"]
mod cluster;
use cluster::*;

/// Both Edges' fleet at start.
fn fleet(mock: SocketAddr) -> String {
    let mut text = String::new();
    for node in ["node-a", "node-b"] {
        text.push_str(&format!(
            "[[nodes]]\nid = \"{node}\"\n\
             [[nodes.adapters]]\nname = \"mock\"\nkind = \"openai_compat\"\n\
             profile = \"openai\"\nbase_url = \"http://{mock}\"\ncapacity = 4\n\
             [[nodes.providers]]\nid = \"mock\"\nadapter = \"mock\"\ntarget = \"mock-model\"\n\
             capacity = 4\n\n"
        ));
    }
    text.push_str(MODEL_A);
    text.push_str(MODEL_B);
    text
}

const MODEL_A: &str =
    "[[models]]\nname = \"model-a\"\nproviders = [\"node-a/mock\"]\nqueue_timeout_ms = 1000\n\n";
const MODEL_B: &str =
    "[[models]]\nname = \"model-b\"\nproviders = [\"node-b/mock\"]\nqueue_timeout_ms = 1000\n\n";
const MODEL_NEW: &str =
    "[[models]]\nname = \"model-new\"\nproviders = [\"node-a/mock\"]\nqueue_timeout_ms = 1000\n";

/// A client key of B's own, allowed `model-b` only.
const READER_KEY: &str = "sk-cluster-test-reader";

fn reader_key_lines() -> String {
    format!(
        "[[client_keys]]\nprincipal = \"reader\"\nkey_hash = \"{}\"\nmodels = [\"model-b\"]\n\n",
        blake3::hash(READER_KEY.as_bytes()).to_hex()
    )
}

fn start(label: &str) -> Cluster {
    Cluster::start(Setup {
        label,
        mock_args: &["--tokens", "3"],
        fleet,
        nodes: &[("node-a", "edge-1")],
        team_limits: "",
    })
}

/// `GET /v1/models` at `edge` with `key`.
fn models_answer(edge: &EdgeProc, key: &str) -> Response {
    let bearer = format!("Bearer {key}");
    request(
        edge.client,
        "GET",
        "/v1/models",
        &[("authorization", &bearer)],
        "",
    )
    .expect("models")
}

/// The model ids `edge` lists to the caller with `key`.
fn models_for(edge: &EdgeProc, key: &str) -> Vec<String> {
    let response = models_answer(edge, key);
    assert_eq!(response.status, 200, "{}: {}", edge.name, response.text());
    response.json()["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id").to_string())
        .collect()
}

fn models(edge: &EdgeProc) -> Vec<String> {
    models_for(edge, CLIENT_KEY)
}

/// `/status` `cluster.fleet` of `edge`.
fn fleet_status(cluster: &Cluster, edge: &EdgeProc) -> Value {
    cluster.status(edge)["cluster"]["fleet"].clone()
}

/// Polls until `done` holds, failing after [`GENEROUS`] with `what`.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let started = clock::now();
    while !done() {
        assert!(started.elapsed() < GENEROUS, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn revision(fleet: &Value) -> u64 {
    fleet["revision"].as_u64().expect("fleet.revision")
}

// One fleet across the cluster: published at start, changed by a SIGHUP
// at A and served by B as it is by A, and applied by B when it restarts
// with a file that still says the old fleet.
#[test]
fn a_fleet_reloaded_at_one_edge_is_served_by_every_edge_and_survives_a_restart() {
    let mut cluster = start("fleet-publish");
    let (a, b) = (&cluster.a, &cluster.b);

    // At start: one Edge published its file's fleet, the other adopted it.
    wait_until("both Edges at one published fleet revision", || {
        let (at_a, at_b) = (fleet_status(&cluster, a), fleet_status(&cluster, b));
        revision(&at_a) > 0 && at_a == at_b
    });
    let initial = fleet_status(&cluster, a);
    assert_eq!(initial["latest_revision"], initial["revision"]);
    assert_eq!(initial["file_differs"], json!(false));
    assert_eq!(initial["refused"], Value::Null);
    assert!(
        initial["source"] == "edge-1" || initial["source"] == "edge-2",
        "{initial}"
    );
    assert_eq!(models(a), ["model-a", "model-b"]);
    assert_eq!(models(b), ["model-a", "model-b"]);

    // A SIGHUP at A that adds a model: B serves it without a reload.
    cluster.edit_and_reload(a, |text| text + MODEL_NEW);
    let three = ["model-a", "model-b", "model-new"];
    wait_until("B lists the model added at A", || models(b) == three);
    assert_eq!(models(a), three);
    wait_until("A and B at one new fleet revision", || {
        let (at_a, at_b) = (fleet_status(&cluster, a), fleet_status(&cluster, b));
        at_a["revision"] == at_b["revision"] && at_a["revision"] != initial["revision"]
    });
    let published = fleet_status(&cluster, b);
    let new_revision = revision(&published);
    assert!(new_revision > revision(&initial), "{published}");
    assert_eq!(published["source"], "edge-1");
    assert_eq!(published["latest_revision"], json!(new_revision));
    // B's file still says the old fleet; A's says this one.
    assert_eq!(published["file_differs"], json!(true));
    assert_eq!(fleet_status(&cluster, a)["file_differs"], json!(false));
    assert_ne!(published["digest"], initial["digest"]);
    for edge in [a, b] {
        assert_eq!(
            cluster.metric(edge, "iop_edge_cluster_fleet_revision"),
            new_revision
        );
        assert_eq!(
            cluster.metric(edge, "iop_edge_cluster_fleet_refused_total"),
            0
        );
    }
    // B serves the new model: its node is A's, so B forwards to A.
    let answer = cluster.chat(b, "model-new", false);
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.json()["object"], "chat.completion");
    cluster.log_line(b, |l| {
        l.contains("model=model-new") && l.contains("forwarded_to=edge-1")
    });

    // B restarted with its file, which still says the old fleet: the
    // published fleet wins once seen, and a warning says the file differs.
    cluster.restart_b();
    let b = &cluster.b;
    wait_until("the restarted B lists the published fleet's models", || {
        models(b) == three
    });
    let restarted = fleet_status(&cluster, b);
    assert_eq!(revision(&restarted), new_revision);
    assert_eq!(restarted["file_differs"], json!(true));
    assert_eq!(restarted["digest"], published["digest"]);
    cluster.log_line(b, |l| {
        l.contains("this Edge's file says another fleet than the cluster's")
    });
    // A's fleet is untouched by B's start.
    assert_eq!(revision(&fleet_status(&cluster, &cluster.a)), new_revision);
    let answer = cluster.chat(b, "model-new", false);
    assert_eq!(answer.status, 200, "{}", answer.text());
}

// A fleet that does not validate against B's own part of its file is
// refused at B (counted, shown, the running fleet stays) and applied at
// A; B applies it at its next reload once its file no longer conflicts,
// without publishing its own (stale) fleet sections.
#[test]
fn a_fleet_invalid_at_one_edge_is_refused_there_and_applied_once_its_file_fits() {
    let cluster = start("fleet-refuse");
    let (a, b) = (&cluster.a, &cluster.b);
    wait_until("both Edges at one published fleet revision", || {
        let (at_a, at_b) = (fleet_status(&cluster, a), fleet_status(&cluster, b));
        revision(&at_a) > 0 && at_a == at_b
    });
    let initial = revision(&fleet_status(&cluster, a));

    // B's own part of its file: a key allowed model-b only. Its fleet is
    // unchanged, so nothing is published and the key applies at once.
    cluster.edit_and_reload(b, |text| {
        text.replace("[cluster]\n", &format!("{}[cluster]\n", reader_key_lines()))
    });
    wait_until("B's reader key in force", || {
        models_answer(b, READER_KEY).status != 401
    });
    assert_eq!(models_for(b, READER_KEY), ["model-b"]);
    assert_eq!(models_answer(a, READER_KEY).status, 401);
    assert_eq!(revision(&fleet_status(&cluster, b)), initial);

    // A removes model-b from the fleet.
    cluster.edit_and_reload(a, |text| text.replace(MODEL_B, ""));
    wait_until("B refused the fleet", || {
        cluster.metric(b, "iop_edge_cluster_fleet_refused_total") == 1
    });
    wait_until("A serves the new fleet", || models(a) == ["model-a"]);
    let at_a = fleet_status(&cluster, a);
    let removed = revision(&at_a);
    assert!(removed > initial, "{at_a}");
    let at_b = fleet_status(&cluster, b);
    assert_eq!(revision(&at_b), initial, "{at_b}");
    assert_eq!(at_b["latest_revision"], json!(removed));
    assert_eq!(
        at_b["refused"],
        json!({
            "revision": removed,
            "reason": format!(
                "does not validate with this Edge's file: {}: client_keys[2].models[0]: \
                 no [[models]] entry is named \"model-b\"",
                cluster.config_path(b)
            ),
        })
    );
    assert_eq!(models(b), ["model-a", "model-b"]);
    assert_eq!(models_for(b, READER_KEY), ["model-b"]);
    assert_eq!(
        cluster.metric(b, "iop_edge_cluster_fleet_revision"),
        initial
    );
    assert_eq!(cluster.metric(a, "iop_edge_cluster_fleet_refused_total"), 0);
    cluster.log_line(b, |l| {
        l.contains(&format!(
            "fleet revision {removed} refused; the running fleet stays"
        ))
    });

    // B's file without the conflicting key (its fleet sections still the
    // old fleet's): B's reload applies the pending fleet and publishes
    // nothing.
    cluster.edit_and_reload(b, |text| text.replace(&reader_key_lines(), ""));
    wait_until("B applied the fleet it refused", || {
        models(b) == ["model-a"]
    });
    let at_b = fleet_status(&cluster, b);
    assert_eq!(revision(&at_b), removed, "{at_b}");
    assert_eq!(at_b["refused"], Value::Null);
    assert_eq!(at_b["file_differs"], json!(true));
    assert_eq!(cluster.metric(b, "iop_edge_cluster_fleet_refused_total"), 1);
    let at_a = fleet_status(&cluster, a);
    assert_eq!(revision(&at_a), removed, "B published nothing: {at_a}");
    assert_eq!(at_a["latest_revision"], json!(removed));
    assert_eq!(models(a), ["model-a"]);
}
