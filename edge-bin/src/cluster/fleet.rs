//! The cluster's fleet (sans-IO): which fleet an Edge of a cluster runs,
//! when it publishes its file's, and whether a published one fits its own
//! file.
//!
//! The fleet is the `[[nodes]]` (with their adapters and providers),
//! `[[models]]` and `[outlier_detection]` sections of `edge.toml`; the rest
//! of the file (`[edge]`, `[tls]`, `[[client_keys]]`, `[credentials]`,
//! `[cluster]`) stays each Edge's own. The cluster's fleet is one etcd key,
//! `/iop/<cluster>/fleet`, holding a [`Document`]; its `mod_revision` is
//! the **fleet revision**. Every Edge applies what its watch sees there,
//! the one that published it included:
//!
//! ```text
//! SIGHUP ─► file valid? ─► its fleet changed since this Edge last read it,
//!               │          and differs from the fleet in force and the
//!               │          newest published? ── yes ─► put /fleet if its mod_revision
//!               │                                      is still the newest seen
//!               └─► the rest of the file applies here, with the fleet in force
//!
//! watch: /fleet put at revision R (newer than any seen) ─► the same fleet as in force? adopt R
//!        ─► else compose: this Edge's file with the fleet's sections ─► valid? apply (server::apply)
//!                                                                   └─► refuse: the running fleet stays
//! range at start (or after a broken watch): no /fleet ─► publish the fleet in force (if still absent)
//! ```
//!
//! [`FleetSync`] holds the decisions; `cluster::member` carries them out
//! (the etcd calls, `server::apply`, the logs and counters).
//!
//! A fleet is compared by [`Fleet::digest`]: BLAKE3 of its canonical text
//! (the sections as TOML with every table's keys sorted), so two files
//! that say the same thing in another order or with other comments have
//! the same fleet.

use std::path::Path;

use crate::config::{ConfigError, EdgeConfig};
use crate::plane::cluster::{FleetRefusal as Refusal, FleetView};

/// The top-level sections of `edge.toml` that make up the fleet.
pub const SECTIONS: [&str; 3] = ["nodes", "models", "outlier_detection"];

/// Largest [`Document`] published or accepted (etcd's own request limit
/// is 1.5 MiB by default).
pub const MAX_DOCUMENT_BYTES: usize = 1024 * 1024;

/// Why a fleet could not be read, published or applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FleetError {
    /// The file or the published fleet is not TOML.
    #[error("not TOML: {reason}")]
    NotToml {
        /// The parser's message.
        reason: String,
    },
    /// The published value is not a fleet document.
    #[error("not a fleet document: {reason}")]
    NotDocument {
        /// What is wrong with it.
        reason: String,
    },
    /// The published document is over [`MAX_DOCUMENT_BYTES`].
    #[error("fleet document of {size_bytes} bytes is over the {max_bytes}-byte cap")]
    TooLarge {
        /// Its size.
        size_bytes: usize,
        /// The cap.
        max_bytes: usize,
    },
    /// The document's digest is not the digest of its fleet text.
    #[error("digest {stated} does not match the fleet text (BLAKE3 {actual})")]
    DigestMismatch {
        /// The digest the document states.
        stated: String,
        /// The digest of its text.
        actual: String,
    },
    /// The published fleet has a section that is not a fleet section.
    #[error("section `{section}` is not part of the fleet (only {})", SECTIONS.join(", "))]
    NotFleetSection {
        /// The section.
        section: String,
    },
    /// This Edge's file with the fleet's sections does not validate.
    #[error("does not validate with this Edge's file: {0}")]
    Invalid(ConfigError),
}

/// The fleet sections of a configuration, canonical.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fleet {
    /// The sections as TOML, every table's keys sorted.
    text: String,
    /// BLAKE3 of `text`, hex.
    digest: String,
}

impl Fleet {
    /// The fleet of `sections` (only fleet sections).
    fn of(sections: toml::Table) -> Self {
        let text = toml::to_string(&sorted_table(sections)).unwrap_or_default();
        let digest = blake3::hash(text.as_bytes()).to_hex().to_string();
        Self { text, digest }
    }

    /// The canonical TOML text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// BLAKE3 of [`Fleet::text`], hex: what tells two fleets apart.
    pub fn digest(&self) -> &str {
        &self.digest
    }
}

/// A configuration file split into this Edge's own part and the fleet.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitFile {
    /// Every section but the fleet's, as written.
    pub local: toml::Table,
    /// The fleet sections.
    pub fleet: Fleet,
}

/// Splits the text of an `edge.toml` into its own part and its fleet.
/// Checks only that it is TOML (the whole file is validated elsewhere).
pub fn split(text: &str) -> Result<SplitFile, FleetError> {
    let mut local: toml::Table =
        text.parse()
            .map_err(|e: toml::de::Error| FleetError::NotToml {
                reason: e.message().to_string(),
            })?;
    let mut sections = toml::Table::new();
    for name in SECTIONS {
        if let Some(value) = local.remove(name) {
            sections.insert(name.to_string(), value);
        }
    }
    Ok(SplitFile {
        local,
        fleet: Fleet::of(sections),
    })
}

/// This Edge's own part with `fleet`'s sections, parsed and validated as a
/// whole file at `path` (which names it in errors and anchors relative
/// paths): the configuration and its text. Touches no file: the adapters'
/// CA files are the caller's to read ([`EdgeConfig::load_provider_cas`]).
pub fn compose(
    local: &toml::Table,
    fleet: &Fleet,
    path: &Path,
) -> Result<(EdgeConfig, String), FleetError> {
    let mut whole = local.clone();
    for name in SECTIONS {
        whole.remove(name);
    }
    let sections: toml::Table =
        fleet
            .text
            .parse()
            .map_err(|e: toml::de::Error| FleetError::NotToml {
                reason: e.message().to_string(),
            })?;
    whole.extend(sections);
    let text = toml::to_string(&whole).map_err(|e| FleetError::NotToml {
        reason: e.to_string(),
    })?;
    let config = EdgeConfig::parse(&text, path).map_err(FleetError::Invalid)?;
    Ok((config, text))
}

/// The value of the fleet key: the fleet, who published it, and its
/// digest. The fleet revision is the key's `mod_revision`, so it is not
/// in the value.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Document {
    /// The name of the Edge that published it.
    pub source: String,
    /// BLAKE3 of `fleet`, hex.
    pub digest: String,
    /// The fleet sections as TOML.
    pub fleet: String,
}

impl Document {
    /// The document publishing `fleet` from Edge `source`.
    pub fn of(fleet: &Fleet, source: &str) -> Self {
        Self {
            source: source.to_string(),
            digest: fleet.digest.clone(),
            fleet: fleet.text.clone(),
        }
    }

    /// The JSON value to put, or why it cannot be published.
    pub fn encode(&self) -> Result<Vec<u8>, FleetError> {
        let bytes = serde_json::to_vec(self).map_err(|e| FleetError::NotDocument {
            reason: e.to_string(),
        })?;
        if bytes.len() > MAX_DOCUMENT_BYTES {
            return Err(FleetError::TooLarge {
                size_bytes: bytes.len(),
                max_bytes: MAX_DOCUMENT_BYTES,
            });
        }
        Ok(bytes)
    }

    /// Reads a value of the fleet key: its source and its fleet (made
    /// canonical). Refuses a value over the cap, one whose digest does not
    /// match its text, and one with a section outside the fleet.
    pub fn decode(value: &[u8]) -> Result<(String, Fleet), FleetError> {
        if value.len() > MAX_DOCUMENT_BYTES {
            return Err(FleetError::TooLarge {
                size_bytes: value.len(),
                max_bytes: MAX_DOCUMENT_BYTES,
            });
        }
        let document: Document =
            serde_json::from_slice(value).map_err(|e| FleetError::NotDocument {
                reason: e.to_string(),
            })?;
        let actual = blake3::hash(document.fleet.as_bytes()).to_hex().to_string();
        if actual != document.digest {
            return Err(FleetError::DigestMismatch {
                stated: document.digest,
                actual,
            });
        }
        let sections: toml::Table =
            document
                .fleet
                .parse()
                .map_err(|e: toml::de::Error| FleetError::NotToml {
                    reason: e.message().to_string(),
                })?;
        if let Some(section) = sections.keys().find(|k| !SECTIONS.contains(&k.as_str())) {
            return Err(FleetError::NotFleetSection {
                section: section.clone(),
            });
        }
        Ok((document.source, Fleet::of(sections)))
    }
}

/// A fleet as published in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The fleet revision: the key's `mod_revision`.
    pub revision: u64,
    /// The Edge that published it.
    pub source: String,
    /// The fleet.
    pub fleet: Fleet,
}

/// What the shell does after seeing the fleet key (or its absence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Nothing: a revision already seen.
    Nothing,
    /// The published fleet is the one in force: its revision is now the
    /// one in force, nothing to apply.
    Adopted,
    /// Compose this Edge's file with the published fleet and apply it
    /// ([`FleetSync::applied`]) or refuse it ([`FleetSync::refused`]).
    Apply(Published),
    /// The cluster has no fleet: publish this one if the key is still
    /// absent (its `mod_revision` 0).
    Publish {
        /// The fleet in force.
        fleet: Fleet,
    },
}

/// What the shell does with a reloaded file's fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reloaded {
    /// The file's fleet is the one in force, or the newest published:
    /// nothing to publish.
    Unchanged,
    /// The file's fleet differs from the one in force, but its fleet
    /// sections did not change since this Edge last read them: the file
    /// lags the cluster's fleet. Not published.
    Stale {
        /// The fleet revision in force.
        in_force: u64,
    },
    /// Publish the file's fleet, if the key's `mod_revision` is still
    /// `expected` (the newest this Edge saw; 0: the key is absent); then
    /// [`FleetSync::file_read`].
    Publish {
        /// The `mod_revision` the put is conditional on.
        expected: u64,
    },
}

/// Where this Edge stands with the cluster's fleet; see the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetSync {
    /// The fleet in force here; revision 0 while it is this Edge's file's,
    /// not (yet) seen in etcd.
    in_force: Published,
    /// The fleet of this Edge's file as last read (at start or at a reload
    /// whose fleet was published or not to be published).
    file: Fleet,
    /// The newest fleet seen in etcd (`None`: none, deleted since, or the
    /// newest value did not decode).
    latest: Option<Published>,
    /// The newest `mod_revision` of the fleet key seen, whatever its value
    /// (0: absent): a publish is conditional on it.
    seen: u64,
    /// The newest published fleet refused here, while it is newer than
    /// the one in force.
    refused: Option<Refusal>,
}

impl FleetSync {
    /// An Edge that started with a file whose fleet is `file`.
    pub fn new(file: Fleet) -> Self {
        Self {
            in_force: Published {
                revision: 0,
                source: String::new(),
                fleet: file.clone(),
            },
            file,
            latest: None,
            seen: 0,
            refused: None,
        }
    }

    /// The fleet in force.
    pub fn in_force(&self) -> &Published {
        &self.in_force
    }

    /// The fleet of this Edge's file, as last read.
    pub fn file(&self) -> &Fleet {
        &self.file
    }

    /// What `/status` and `/metrics` show.
    pub fn status(&self) -> FleetView {
        FleetView {
            revision: self.in_force.revision,
            digest: self.in_force.fleet.digest.clone(),
            source: self.in_force.source.clone(),
            latest_revision: self.seen,
            file_differs: self.file.digest != self.in_force.fleet.digest,
            refused: self.refused.clone(),
        }
    }

    /// The watch (or a full read) saw the fleet key put at
    /// `published.revision`.
    pub fn on_put(&mut self, published: Published) -> Seen {
        if published.revision <= self.seen {
            return Seen::Nothing;
        }
        self.seen = published.revision;
        self.latest = Some(published.clone());
        if published.fleet.digest == self.in_force.fleet.digest {
            self.in_force = published;
            self.refused = None;
            return Seen::Adopted;
        }
        Seen::Apply(published)
    }

    /// A full read of the cluster's keys found no fleet key: the first
    /// Edge to see so publishes the fleet it runs.
    pub fn on_absent(&mut self) -> Seen {
        self.latest = None;
        self.seen = 0;
        Seen::Publish {
            fleet: self.in_force.fleet.clone(),
        }
    }

    /// The watch saw the fleet key deleted: as if absent (the running
    /// fleet stays, and is published again).
    pub fn on_deleted(&mut self) -> Seen {
        self.on_absent()
    }

    /// The fleet key was put at `revision` with a value that is not a
    /// fleet (`reason`): refused like a fleet that does not validate.
    /// Whether it is news (not a revision already seen).
    pub fn on_malformed(&mut self, revision: u64, reason: String) -> bool {
        if revision <= self.seen {
            return false;
        }
        self.seen = revision;
        self.latest = None;
        self.refused(revision, reason);
        true
    }

    /// `published` (from [`Seen::Apply`]) now runs here.
    pub fn applied(&mut self, published: Published) {
        self.in_force = published;
        self.refused = None;
    }

    /// The fleet of `revision` was refused here, for `reason`.
    pub fn refused(&mut self, revision: u64, reason: String) {
        self.refused = Some(Refusal { revision, reason });
    }

    /// A published fleet newer than the one in force that was refused
    /// here: to try again once this Edge's own part changed (a reload).
    pub fn pending(&self) -> Option<Published> {
        let latest = self.latest.as_ref()?;
        (latest.revision > self.in_force.revision
            && latest.fleet.digest != self.in_force.fleet.digest)
            .then(|| latest.clone())
    }

    /// A reload read a valid file whose fleet is `file`: whether to
    /// publish it. Changes nothing; the shell calls
    /// [`FleetSync::file_read`] unless a publish fails.
    pub fn on_reload(&self, file: &Fleet) -> Reloaded {
        let published = self
            .latest
            .as_ref()
            .is_some_and(|l| l.fleet.digest == file.digest);
        if file.digest == self.in_force.fleet.digest || published {
            return Reloaded::Unchanged;
        }
        if file.digest == self.file.digest {
            return Reloaded::Stale {
                in_force: self.in_force.revision,
            };
        }
        Reloaded::Publish {
            expected: self.seen,
        }
    }

    /// The reloaded file's fleet is `file` (published, or nothing to
    /// publish): later reloads compare with it.
    pub fn file_read(&mut self, file: Fleet) {
        self.file = file;
    }
}

/// `value` with every table's keys in order, at every depth.
fn sorted(value: toml::Value) -> toml::Value {
    match value {
        toml::Value::Table(table) => toml::Value::Table(sorted_table(table)),
        toml::Value::Array(items) => toml::Value::Array(items.into_iter().map(sorted).collect()),
        other => other,
    }
}

fn sorted_table(table: toml::Table) -> toml::Table {
    let mut entries: Vec<(String, toml::Value)> = table.into_iter().collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    entries.into_iter().map(|(k, v)| (k, sorted(v))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: &str = "[edge]\nname = \"edge-2\"\ntrust_domain = \"iop.test\"\n\
        client_listen = \"127.0.0.1:0\"\nnode_listen = \"127.0.0.1:0\"\n\
        insecure_plaintext_nodes = true\nallow_anonymous = true\n";

    fn node(id: &str, providers: &[&str]) -> String {
        let mut text = format!(
            "[[nodes]]\nid = \"{id}\"\n[[nodes.adapters]]\nname = \"mock\"\n\
             kind = \"openai_compat\"\nbase_url = \"http://127.0.0.1:9000\"\n"
        );
        for p in providers {
            text.push_str(&format!(
                "[[nodes.providers]]\nid = \"{p}\"\nadapter = \"mock\"\ntarget = \"m\"\ncapacity = 1\n"
            ));
        }
        text
    }

    fn model(name: &str, providers: &[&str]) -> String {
        let list: Vec<String> = providers.iter().map(|p| format!("\"{p}\"")).collect();
        format!(
            "[[models]]\nname = \"{name}\"\nproviders = [{}]\n",
            list.join(", ")
        )
    }

    fn fleet_of(text: &str) -> Fleet {
        split(text).unwrap().fleet
    }

    fn published(revision: u64, fleet: &Fleet) -> Published {
        Published {
            revision,
            source: "edge-1".into(),
            fleet: fleet.clone(),
        }
    }

    #[test]
    fn a_file_splits_into_its_own_part_and_a_canonical_fleet() {
        let text = format!(
            "{LOCAL}{}{}[outlier_detection]\nenabled = false\n",
            node("node-a", &["p1"]),
            model("m-1", &["node-a/p1"])
        );
        let file = split(&text).unwrap();
        let mut keys: Vec<&String> = file.local.keys().collect();
        keys.sort();
        assert_eq!(keys, ["edge"]);
        let sections: toml::Table = file.fleet.text().parse().unwrap();
        let mut names: Vec<&String> = sections.keys().collect();
        names.sort();
        assert_eq!(names, ["models", "nodes", "outlier_detection"]);
        assert_eq!(
            file.fleet.digest(),
            blake3::hash(file.fleet.text().as_bytes()).to_hex().as_str()
        );
        // The same fleet written in another order, with comments and
        // other spacing, is the same fleet; a changed capacity is not.
        let reordered = format!(
            "[outlier_detection]\nenabled = false\n{}# a comment\n[[nodes]]\n\
             id = \"node-a\"\n[[nodes.providers]]\ncapacity = 1\ntarget = \"m\"\n\
             adapter = \"mock\"\nid = \"p1\"\n[[nodes.adapters]]\nbase_url = \"http://127.0.0.1:9000\"\n\
             kind = \"openai_compat\"\nname = \"mock\"\n{LOCAL}",
            model("m-1", &["node-a/p1"])
        );
        assert_eq!(fleet_of(&reordered), file.fleet);
        assert_ne!(
            fleet_of(&text.replace("capacity = 1", "capacity = 2")),
            file.fleet
        );
        assert!(matches!(split("[edge\n"), Err(FleetError::NotToml { .. })));
    }

    #[test]
    fn a_composed_file_takes_the_fleet_and_keeps_its_own_part() {
        let own = split(&format!(
            "{LOCAL}{}{}",
            node("node-a", &["p1"]),
            model("m-1", &["node-a/p1"])
        ))
        .unwrap();
        let other = fleet_of(&format!(
            "{LOCAL}{}{}{}",
            node("node-a", &["p1"]),
            node("node-b", &["p2"]),
            model("m-2", &["node-a/p1", "node-b/p2"])
        ));
        let (config, text) = compose(&own.local, &other, Path::new("/etc/iop/edge.toml")).unwrap();
        assert_eq!(config.edge.name, "edge-2");
        let nodes: Vec<&str> = config.nodes.iter().map(|n| n.id.as_str()).collect();
        assert_eq!(nodes, ["node-a", "node-b"]);
        let models: Vec<&str> = config.models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(models, ["m-2"]);
        // What was composed splits back into the same two parts.
        let again = split(&text).unwrap();
        assert_eq!(again.fleet, other);
        assert_eq!(again.local, own.local);
    }

    // The published fleet is checked against this Edge's own part: a
    // credential slot (kept per Edge) naming a provider the fleet removed,
    // or a client key allowed a model it removed, refuses it with the key
    // and the reason.
    #[test]
    fn a_fleet_that_leaves_this_edges_file_invalid_is_refused_with_the_reason() {
        let slot = "[credentials]\nissuer_key = \"issuer.key\"\n\
            [[credentials.slots]]\nname = \"upstream\"\nsecret_env = \"UPSTREAM_KEY\"\n\
            providers = [\"node-a/p1\"]\n";
        let tls = "[tls]\nca = \"ca.pem\"\ncert = \"edge.pem\"\nkey = \"edge-key.pem\"\n";
        let local = LOCAL.replace("insecure_plaintext_nodes = true\n", "");
        let own = split(&format!(
            "{local}{tls}{slot}{}{}",
            node("node-a", &["p1"]),
            model("m-1", &["node-a/p1"])
        ))
        .unwrap();
        let without_p1 = fleet_of(&format!(
            "{}{}",
            node("node-a", &["p9"]),
            model("m-1", &["node-a/p9"])
        ));
        let path = Path::new("/etc/iop/edge.toml");
        match compose(&own.local, &without_p1, path) {
            Err(FleetError::Invalid(e)) => {
                assert_eq!(e.key(), "credentials.slots[0].providers[0]");
                assert_eq!(e.file(), "/etc/iop/edge.toml");
            }
            other => panic!("{other:?}"),
        }
        let key = format!(
            "[[client_keys]]\nprincipal = \"reader\"\nkey_hash = \"{}\"\nmodels = [\"m-1\"]\n",
            blake3::hash(b"sk").to_hex()
        );
        let own = split(&format!(
            "{LOCAL}{key}{}{}",
            node("node-a", &["p1"]),
            model("m-1", &["node-a/p1"])
        ))
        .unwrap();
        let renamed = fleet_of(&format!(
            "{}{}",
            node("node-a", &["p1"]),
            model("m-2", &["node-a/p1"])
        ));
        let refused = compose(&own.local, &renamed, path).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "does not validate with this Edge's file: /etc/iop/edge.toml: client_keys[0].models[0]: \
             no [[models]] entry is named \"m-1\""
        );
    }

    #[test]
    fn a_document_round_trips_and_a_tampered_or_foreign_one_is_refused() {
        let fleet = fleet_of(&format!(
            "{LOCAL}{}{}",
            node("node-a", &["p1"]),
            model("m-1", &["node-a/p1"])
        ));
        let bytes = Document::of(&fleet, "edge-1").encode().unwrap();
        assert_eq!(
            Document::decode(&bytes),
            Ok(("edge-1".to_string(), fleet.clone()))
        );
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(value["digest"], fleet.digest());
        assert_eq!(value["fleet"], fleet.text());

        let mut tampered = Document::of(&fleet, "edge-1");
        tampered.fleet = tampered.fleet.replace("capacity = 1", "capacity = 9");
        assert!(matches!(
            Document::decode(&serde_json::to_vec(&tampered).unwrap()),
            Err(FleetError::DigestMismatch { .. })
        ));
        // A document may not carry another section over this Edge's own.
        let keys = "[[client_keys]]\nprincipal = \"x\"\nkey_hash = \"00\"\n";
        let foreign = Document {
            source: "edge-1".into(),
            digest: blake3::hash(keys.as_bytes()).to_hex().to_string(),
            fleet: keys.into(),
        };
        assert_eq!(
            Document::decode(&serde_json::to_vec(&foreign).unwrap()),
            Err(FleetError::NotFleetSection {
                section: "client_keys".into()
            })
        );
        assert!(matches!(
            Document::decode(b"{\"source\":\"e\"}"),
            Err(FleetError::NotDocument { .. })
        ));
        let huge = vec![b' '; MAX_DOCUMENT_BYTES + 1];
        assert_eq!(
            Document::decode(&huge),
            Err(FleetError::TooLarge {
                size_bytes: MAX_DOCUMENT_BYTES + 1,
                max_bytes: MAX_DOCUMENT_BYTES
            })
        );
    }

    // The published fleet wins once seen: an Edge whose file says another
    // fleet applies the published one; the same fleet is adopted without
    // applying; an older or repeated revision changes nothing.
    #[test]
    fn the_newest_published_fleet_wins_and_an_equal_one_is_adopted() {
        let a = fleet_of(&node("node-a", &["p1"]));
        let b = fleet_of(&node("node-b", &["p1"]));
        let mut sync = FleetSync::new(a.clone());
        assert_eq!(sync.status().revision, 0);
        assert_eq!(sync.on_put(published(7, &a)), Seen::Adopted);
        assert_eq!(
            sync.status(),
            FleetView {
                revision: 7,
                digest: a.digest().into(),
                source: "edge-1".into(),
                latest_revision: 7,
                file_differs: false,
                refused: None,
            }
        );
        assert_eq!(sync.on_put(published(9, &b)), Seen::Apply(published(9, &b)));
        sync.applied(published(9, &b));
        assert_eq!(sync.in_force(), &published(9, &b));
        assert!(sync.status().file_differs);
        // A full read after a broken watch shows what was already seen.
        assert_eq!(sync.on_put(published(9, &b)), Seen::Nothing);
        assert_eq!(sync.on_put(published(8, &a)), Seen::Nothing);
        assert_eq!(sync.in_force().revision, 9);
    }

    // A refused fleet leaves the running one in force, stays visible, and
    // is tried again after a reload; a newer one replaces the refusal.
    #[test]
    fn a_refused_fleet_keeps_the_running_one_and_is_pending_until_applied() {
        let a = fleet_of(&node("node-a", &["p1"]));
        let b = fleet_of(&node("node-b", &["p1"]));
        let c = fleet_of(&node("node-c", &["p1"]));
        let mut sync = FleetSync::new(a.clone());
        assert_eq!(sync.on_put(published(3, &a)), Seen::Adopted);
        assert_eq!(sync.on_put(published(5, &b)), Seen::Apply(published(5, &b)));
        sync.refused(5, "no".into());
        let status = sync.status();
        assert_eq!((status.revision, status.latest_revision), (3, 5));
        assert_eq!(
            status.refused,
            Some(Refusal {
                revision: 5,
                reason: "no".into()
            })
        );
        assert_eq!(sync.pending(), Some(published(5, &b)));
        // The cluster goes back to the fleet in force: adopted, nothing
        // pending, no refusal shown.
        assert_eq!(sync.on_put(published(6, &a)), Seen::Adopted);
        assert_eq!(sync.pending(), None);
        assert_eq!(sync.status().refused, None);
        assert_eq!(sync.on_put(published(8, &c)), Seen::Apply(published(8, &c)));
        sync.applied(published(8, &c));
        assert_eq!(sync.pending(), None);
    }

    // A reload publishes the file's fleet only when the operator changed
    // it: a file that lags the cluster (its fleet sections unchanged since
    // this Edge read them) never takes the cluster back to it.
    #[test]
    fn a_reload_publishes_a_changed_fleet_and_never_a_stale_file() {
        let a = fleet_of(&node("node-a", &["p1"]));
        let b = fleet_of(&node("node-b", &["p1"]));
        let c = fleet_of(&node("node-c", &["p1"]));
        let mut sync = FleetSync::new(a.clone());
        // Nothing published yet: the first Edge to see so publishes.
        assert_eq!(sync.on_absent(), Seen::Publish { fleet: a.clone() });
        assert_eq!(sync.on_reload(&a), Reloaded::Unchanged);
        assert_eq!(sync.on_reload(&b), Reloaded::Publish { expected: 0 });
        assert_eq!(sync.on_put(published(4, &a)), Seen::Adopted);
        assert_eq!(sync.on_reload(&b), Reloaded::Publish { expected: 4 });
        // Another Edge published b: this Edge's file (still a) lags.
        assert_eq!(sync.on_put(published(6, &b)), Seen::Apply(published(6, &b)));
        sync.applied(published(6, &b));
        assert_eq!(sync.on_reload(&a), Reloaded::Stale { in_force: 6 });
        // The operator brings the file up to date, or changes it again.
        assert_eq!(sync.on_reload(&b), Reloaded::Unchanged);
        assert_eq!(sync.on_reload(&c), Reloaded::Publish { expected: 6 });
        sync.file_read(c.clone());
        assert_eq!(sync.on_reload(&a), Reloaded::Publish { expected: 6 });
        // A file that says the newest published fleet (refused here) is
        // not published again: the reload retries applying it.
        assert_eq!(sync.on_put(published(9, &c)), Seen::Apply(published(9, &c)));
        sync.refused(9, "no".into());
        assert_eq!(sync.on_reload(&c), Reloaded::Unchanged);
        assert_eq!(sync.pending(), Some(published(9, &c)));
        // A value that is not a fleet is refused once; a publish is
        // conditional on its revision, and nothing is pending.
        assert!(sync.on_malformed(11, "not a fleet document".into()));
        assert!(!sync.on_malformed(11, "not a fleet document".into()));
        assert_eq!(sync.pending(), None);
        assert_eq!(sync.status().latest_revision, 11);
        assert_eq!(sync.on_reload(&a), Reloaded::Publish { expected: 11 });
        // The key deleted: the fleet in force is published again.
        assert_eq!(sync.on_deleted(), Seen::Publish { fleet: b.clone() });
        assert_eq!(sync.on_reload(&a), Reloaded::Publish { expected: 0 });
    }
}
