//! The checks that turn the `Raw*` mirrors of the file into the public
//! types: names, ranges, references, URLs, the credential plane.

use super::*;

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

pub(super) struct Validator<'a> {
    pub(super) file: &'a Path,
}

impl Validator<'_> {
    fn err(&self, key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
        ConfigError::new(self.file, key, reason)
    }

    pub(super) fn edge_config(&self, mut raw: RawEdgeFile) -> Result<EdgeConfig, ConfigError> {
        let client_tls = match raw.edge.client_tls.take() {
            None => None,
            Some(t) => Some(HttpsFiles {
                cert: resolve_path(self.file, "edge.client_tls.cert", &t.cert)?,
                key: resolve_path(self.file, "edge.client_tls.key", &t.key)?,
                client_ca: match t.client_ca {
                    None => None,
                    Some(ca) => Some(resolve_path(self.file, "edge.client_tls.client_ca", &ca)?),
                },
            }),
        };
        let access_log = self.access_log(raw.edge.access_log.take())?;
        let usage_log = match raw.edge.usage_log.take() {
            None => None,
            Some(RawUsageLog { path }) if path.is_empty() => {
                return Err(self.err("edge.usage_log.path", "must be a file path"))
            }
            Some(RawUsageLog { path }) => {
                Some(resolve_path(self.file, "edge.usage_log.path", &path)?)
            }
        };
        let budget_file = match raw.edge.budget_file.take() {
            None => None,
            Some(path) if path.is_empty() => {
                return Err(self.err("edge.budget_file", "must be a file path"))
            }
            Some(path) => Some(resolve_path(self.file, "edge.budget_file", &path)?),
        };
        let edge = self.edge(raw.edge)?;
        let tls = match (edge.insecure_plaintext_nodes, raw.tls) {
            (true, _) => None,
            (false, Some(tls)) => Some(tls.resolve(self.file)?),
            (false, None) => {
                return Err(self.err(
                    "tls",
                    "required unless edge.insecure_plaintext_nodes = true",
                ))
            }
        };
        let mut nodes: Vec<NodeSpec> = Vec::with_capacity(raw.nodes.len());
        for (i, raw_node) in raw.nodes.into_iter().enumerate() {
            let node = self.node(i, raw_node)?;
            if let Some(first) = nodes.iter().position(|n| n.id == node.id) {
                return Err(self.err(
                    format!("nodes[{i}].id"),
                    format!("duplicate node id {:?} (also nodes[{first}])", node.id),
                ));
            }
            nodes.push(node);
        }
        let mut models: Vec<ModelSpec> = Vec::with_capacity(raw.models.len());
        for (i, raw_model) in raw.models.into_iter().enumerate() {
            let model = self.model(i, raw_model, &nodes)?;
            if let Some(first) = models.iter().position(|m| m.name == model.name) {
                return Err(self.err(
                    format!("models[{i}].name"),
                    format!(
                        "duplicate model name {:?} (also models[{first}])",
                        model.name
                    ),
                ));
            }
            models.push(model);
        }
        let credentials = match raw.credentials {
            None => None,
            Some(_) if edge.insecure_plaintext_nodes => {
                // T5: plain TCP carries no lease; refuse instead of silently
                // sending provider traffic without the credential plane.
                return Err(self.err(
                    "credentials",
                    "the credential plane needs mTLS to the nodes: remove [credentials] or \
                     edge.insecure_plaintext_nodes",
                ));
            }
            Some(raw) => Some(self.credentials(raw, &nodes)?),
        };
        if let Some(credentials) = &credentials {
            self.check_managed_nodes(credentials, &nodes)?;
        }
        let client_keys = self.client_keys(raw.client_keys, &models)?;
        if budget_file.is_none() {
            if let Some((i, k)) = client_keys
                .iter()
                .enumerate()
                .find(|(_, k)| !k.budgets.is_unlimited())
            {
                let field = if k.budgets.tokens_per_day.is_some() {
                    "tokens_per_day"
                } else {
                    "tokens_per_month"
                };
                return Err(self.err(
                    format!("client_keys[{i}].{field}"),
                    "a token budget needs edge.budget_file (where the Edge keeps what was used \
                     across restarts)",
                ));
            }
        }
        if edge.metrics_access == MetricsAccess::Key
            && !client_keys.iter().any(|k| k.admin || k.metrics)
        {
            return Err(self.err(
                "edge.metrics_access",
                "\"key\" needs a [[client_keys]] entry with scopes = [\"metrics\"] (or \"admin\") \
                 to read /metrics",
            ));
        }
        let outlier_detection = self.outlier_detection(raw.outlier_detection)?;
        let routing = self.routing(raw.routing)?;
        let cluster = raw
            .cluster
            .map(|c| self.cluster(c, tls.is_some()))
            .transpose()?;
        let tracing = match raw.tracing {
            None => None,
            Some(t) => TracingSpec::from_raw(
                t.otlp_endpoint.as_deref(),
                t.sample_ratio,
                t.service_name.as_deref(),
                DEFAULT_TRACING_SERVICE_NAME,
            )
            .map_err(|(key, why)| self.err(format!("tracing.{key}"), why))?,
        };
        Ok(EdgeConfig {
            source: self.file.to_path_buf(),
            edge,
            tls,
            client_tls,
            access_log,
            usage_log,
            budget_file,
            nodes,
            models,
            credentials,
            client_keys,
            outlier_detection,
            routing,
            cluster,
            tracing,
        })
    }

    /// `[cluster]`; `tls`: whether `[tls]` is set (the peer listener
    /// needs its identity).
    fn cluster(&self, raw: RawCluster, tls: bool) -> Result<ClusterSpec, ConfigError> {
        let name = raw.name.unwrap_or_else(|| DEFAULT_CLUSTER_NAME.to_string());
        check_name(&name).map_err(|why| self.err("cluster.name", why))?;
        if raw.etcd_endpoints.is_empty() {
            return Err(self.err(
                "cluster.etcd_endpoints",
                "list at least one etcd client endpoint (\"host:port\")",
            ));
        }
        for (i, endpoint) in raw.etcd_endpoints.iter().enumerate() {
            check_host_port(endpoint)
                .map_err(|why| self.err(format!("cluster.etcd_endpoints[{i}]"), why))?;
        }
        let seconds = |v: Option<i64>, key: &str, default: u64| match v {
            None => Ok(default),
            Some(v) => in_range(v, 1, 3600).map_err(|why| self.err(format!("cluster.{key}"), why)),
        };
        let lease_ttl_sec = seconds(raw.lease_ttl_sec, "lease_ttl_sec", DEFAULT_LEASE_TTL_SEC)?;
        let keepalive_interval_sec = seconds(
            raw.keepalive_interval_sec,
            "keepalive_interval_sec",
            DEFAULT_KEEPALIVE_INTERVAL_SEC.min(lease_ttl_sec.saturating_sub(1).max(1)),
        )?;
        if keepalive_interval_sec * 2 > lease_ttl_sec {
            return Err(self.err(
                "cluster.keepalive_interval_sec",
                format!(
                    "must be at most half of lease_ttl_sec ({lease_ttl_sec}): the edge fences what it \
                     owns lease_ttl_sec - keepalive_interval_sec after the last acknowledged keep-alive"
                ),
            ));
        }
        let etcd_timeout_ms = match raw.etcd_timeout_ms {
            None => DEFAULT_ETCD_TIMEOUT_MS,
            Some(v) => {
                in_range(v, 10, 60_000).map_err(|why| self.err("cluster.etcd_timeout_ms", why))?
            }
        };
        let peer_listen = match raw.peer_listen.as_deref() {
            None => None,
            Some(_) if !tls => {
                return Err(self.err(
                    "cluster.peer_listen",
                    "needs [tls]: other Edges are served over mTLS with this Edge's identity",
                ))
            }
            Some(text) => {
                Some(parse_socket_addr(text).map_err(|why| self.err("cluster.peer_listen", why))?)
            }
        };
        Ok(ClusterSpec {
            name,
            etcd_endpoints: raw.etcd_endpoints,
            lease_ttl_sec,
            keepalive_interval_sec,
            etcd_timeout_ms,
            peer_listen,
        })
    }

    fn access_log(&self, raw: Option<RawAccessLog>) -> Result<AccessLogSpec, ConfigError> {
        let Some(raw) = raw else {
            return Ok(AccessLogSpec::default());
        };
        let destination = match raw.destination.as_deref() {
            None | Some("stderr") => Destination::Stderr,
            Some("off") => Destination::Off,
            Some("") => {
                return Err(self.err(
                    "edge.access_log.destination",
                    "must be \"stderr\", \"off\" or a file path",
                ))
            }
            Some(path) => Destination::File(resolve_path(
                self.file,
                "edge.access_log.destination",
                path,
            )?),
        };
        let format = match raw.format.as_deref() {
            None | Some("text") => Format::Text,
            Some("json") => Format::Json,
            Some(other) => {
                return Err(self.err(
                    "edge.access_log.format",
                    format!("must be \"text\" or \"json\", not {other:?}"),
                ))
            }
        };
        Ok(AccessLogSpec {
            destination,
            format,
            format_explicit: raw.format.is_some(),
        })
    }

    fn routing(&self, raw: Option<RawRouting>) -> Result<RoutingSettings, ConfigError> {
        let defaults = RoutingSettings::default();
        let Some(raw) = raw else {
            return Ok(defaults);
        };
        let value = |v: Option<i64>, key: &str, default: u64, min: u64, max: u64| match v {
            None => Ok(default),
            Some(v) => in_range(v, min, max).map_err(|why| self.err(format!("routing.{key}"), why)),
        };
        Ok(RoutingSettings {
            prefix_tree_bytes: value(
                raw.prefix_tree_bytes,
                "prefix_tree_bytes",
                defaults.prefix_tree_bytes,
                MIN_PREFIX_TREE_BYTES,
                MAX_PREFIX_TREE_BYTES,
            )?,
            prefix_bytes_max: value(
                raw.prefix_bytes_max,
                "prefix_bytes_max",
                defaults.prefix_bytes_max,
                1,
                MAX_PREFIX_BYTES_MAX,
            )?,
            match_threshold_percent: value(
                raw.match_threshold_percent,
                "match_threshold_percent",
                u64::from(defaults.match_threshold_percent),
                0,
                100,
            )? as u32,
            balance_abs_threshold: value(
                raw.balance_abs_threshold,
                "balance_abs_threshold",
                u64::from(defaults.balance_abs_threshold),
                0,
                u64::from(MAX_BALANCE_ABS_THRESHOLD),
            )? as u32,
            balance_rel_threshold_percent: value(
                raw.balance_rel_threshold_percent,
                "balance_rel_threshold_percent",
                u64::from(defaults.balance_rel_threshold_percent),
                100,
                u64::from(MAX_BALANCE_REL_THRESHOLD_PERCENT),
            )? as u32,
            affinity_wait_ms: value(
                raw.affinity_wait_ms,
                "affinity_wait_ms",
                defaults.affinity_wait_ms,
                0,
                MAX_AFFINITY_WAIT_MS,
            )?,
        })
    }

    fn outlier_detection(
        &self,
        raw: Option<RawOutlierDetection>,
    ) -> Result<OutlierDetection, ConfigError> {
        let defaults = OutlierDetection::default();
        let Some(raw) = raw else {
            return Ok(defaults);
        };
        let value = |v: Option<i64>, key: &str, default: u64, min: u64, max: u64| match v {
            None => Ok(default),
            Some(v) => in_range(v, min, max)
                .map_err(|why| self.err(format!("outlier_detection.{key}"), why)),
        };
        let base_ejection_time_ms = value(
            raw.base_ejection_time_ms,
            "base_ejection_time_ms",
            defaults.base_ejection_time_ms,
            1,
            MAX_EJECTION_TIME_LIMIT_MS,
        )?;
        let max_ejection_time_ms = value(
            raw.max_ejection_time_ms,
            "max_ejection_time_ms",
            defaults.max_ejection_time_ms.max(base_ejection_time_ms),
            base_ejection_time_ms,
            MAX_EJECTION_TIME_LIMIT_MS,
        )?;
        Ok(OutlierDetection {
            enabled: raw.enabled.unwrap_or(true),
            consecutive_failures: value(
                raw.consecutive_failures,
                "consecutive_failures",
                u64::from(defaults.consecutive_failures),
                1,
                u64::from(MAX_CONSECUTIVE_FAILURES),
            )? as u32,
            base_ejection_time_ms,
            max_ejection_time_ms,
            max_ejection_percent: value(
                raw.max_ejection_percent,
                "max_ejection_percent",
                u64::from(defaults.max_ejection_percent),
                0,
                100,
            )? as u32,
        })
    }

    fn credentials(
        &self,
        raw: RawCredentials,
        nodes: &[NodeSpec],
    ) -> Result<CredentialsSpec, ConfigError> {
        let issuer_key = resolve_path(self.file, "credentials.issuer_key", &raw.issuer_key)?;
        let lease_ttl_ms = match raw.lease_ttl_ms {
            None => DEFAULT_LEASE_TTL_MS,
            Some(v) => in_range(v, MIN_LEASE_TTL_MS, MAX_LEASE_TTL_MS)
                .map_err(|why| self.err("credentials.lease_ttl_ms", why))?,
        };
        let mut slots: Vec<SlotSpec> = Vec::with_capacity(raw.slots.len());
        for (i, raw_slot) in raw.slots.into_iter().enumerate() {
            let key = format!("credentials.slots[{i}]");
            let slot = self.slot(&key, raw_slot, nodes)?;
            if let Some(first) = slots.iter().position(|s| s.name == slot.name) {
                return Err(self.err(
                    format!("{key}.name"),
                    format!(
                        "duplicate slot name {:?} (also credentials.slots[{first}])",
                        slot.name
                    ),
                ));
            }
            for (j, provider) in slot.providers.iter().enumerate() {
                if let Some(other) = slots.iter().find(|s| s.providers.contains(provider)) {
                    // C5: one slot per route, so there is never another slot
                    // to fall back to.
                    return Err(self.err(
                        format!("{key}.providers[{j}]"),
                        format!(
                            "\"{provider}\" is already served by slot {:?}; a provider is served by \
                             at most one slot",
                            other.name
                        ),
                    ));
                }
            }
            slots.push(slot);
        }
        Ok(CredentialsSpec {
            issuer_key,
            lease_ttl_ms,
            slots,
        })
    }

    fn slot(&self, key: &str, raw: RawSlot, nodes: &[NodeSpec]) -> Result<SlotSpec, ConfigError> {
        check_name(&raw.name).map_err(|why| self.err(format!("{key}.name"), why))?;
        let secret = match (raw.secret_file, raw.secret_env) {
            (Some(file), None) => SecretSource::File(resolve_path(
                self.file,
                &format!("{key}.secret_file"),
                &file,
            )?),
            (None, Some(env)) => {
                check_env_name(&env).map_err(|why| self.err(format!("{key}.secret_env"), why))?;
                SecretSource::Env(env)
            }
            (Some(_), Some(_)) | (None, None) => {
                return Err(self.err(key, "set exactly one of secret_file or secret_env"))
            }
        };
        let header_name = raw.header.unwrap_or_else(|| DEFAULT_SLOT_HEADER.to_owned());
        check_header_name(&header_name).map_err(|why| self.err(format!("{key}.header"), why))?;
        let header_format = raw.format.unwrap_or_else(|| DEFAULT_SLOT_FORMAT.to_owned());
        check_header_format(&header_format)
            .map_err(|why| self.err(format!("{key}.format"), why))?;
        let revision = match raw.revision {
            None => 1,
            Some(v) => in_range(v, 1, i64::MAX as u64)
                .map_err(|why| self.err(format!("{key}.revision"), why))?,
        };
        let mut revoked_revisions: Vec<u64> = Vec::with_capacity(raw.revoked_revisions.len());
        for (j, v) in raw.revoked_revisions.into_iter().enumerate() {
            let rkey = format!("{key}.revoked_revisions[{j}]");
            let v = in_range(v, 1, i64::MAX as u64).map_err(|why| self.err(&rkey, why))?;
            if revoked_revisions.contains(&v) {
                return Err(self.err(rkey, format!("revision {v} is listed twice")));
            }
            revoked_revisions.push(v);
        }
        if raw.providers.is_empty() {
            return Err(self.err(
                format!("{key}.providers"),
                "must list at least one provider",
            ));
        }
        let mut providers: Vec<ProviderRef> = Vec::with_capacity(raw.providers.len());
        for (j, text) in raw.providers.iter().enumerate() {
            let pkey = format!("{key}.providers[{j}]");
            let provider = self.provider_ref(&pkey, text, nodes)?;
            if let Some(first) = providers.iter().position(|p| *p == provider) {
                return Err(self.err(
                    pkey,
                    format!("{text:?} is listed twice (also {key}.providers[{first}])"),
                ));
            }
            let node = nodes.iter().find(|n| n.id == provider.node_id);
            let kind = node
                .and_then(|n| n.provider(&provider.provider_id))
                .and_then(|p| node.and_then(|n| n.adapter(&p.adapter)))
                .map(|a| a.kind);
            if !matches!(kind, Some(AdapterKind::OpenAiCompat { .. })) {
                return Err(self.err(
                    pkey,
                    format!(
                        "{text:?} is not served by an openai_compat adapter; credential leases \
                         travel only on provider tunnels"
                    ),
                ));
            }
            let unverified = node
                .and_then(|n| n.provider(&provider.provider_id))
                .and_then(|p| node.and_then(|n| n.adapter(&p.adapter)))
                .is_some_and(|a| a.tls.insecure_skip_verify);
            if unverified {
                return Err(self.err(
                    pkey,
                    format!(
                        "{text:?} is served by an adapter with tls_insecure_skip_verify; a \
                         credential is never sent to a provider whose certificate is not verified"
                    ),
                ));
            }
            providers.push(provider);
        }
        Ok(SlotSpec {
            name: raw.name,
            secret,
            header_name,
            header_format,
            revision,
            revoked_revisions,
            enabled: raw.enabled.unwrap_or(true),
            providers,
        })
    }

    /// With the issuer configured: every node a slot serves has a recipient
    /// key, and every tunnel provider of a node with a key is served by a
    /// slot (that node rejects tunnels without a lease, C3).
    fn check_managed_nodes(
        &self,
        credentials: &CredentialsSpec,
        nodes: &[NodeSpec],
    ) -> Result<(), ConfigError> {
        for (i, node) in nodes.iter().enumerate() {
            let has_key = node.recipient_key.is_some();
            let served = credentials.slots.iter().find_map(|slot| {
                slot.providers
                    .iter()
                    .find(|p| p.node_id == node.id)
                    .map(|p| (slot, p))
            });
            if let (false, Some((slot, provider))) = (has_key, served) {
                return Err(self.err(
                    format!("nodes[{i}].recipient_key"),
                    format!(
                        "required: provider \"{provider}\" is served by credential slot {:?} \
                         (node-bin keys recipient --out … prints it)",
                        slot.name
                    ),
                ));
            }
            if !has_key {
                continue;
            }
            for (j, provider) in node.providers.iter().enumerate() {
                let tunnel = matches!(
                    node.adapter(&provider.adapter).map(|a| a.kind),
                    Some(AdapterKind::OpenAiCompat { .. })
                );
                let reference = ProviderRef {
                    node_id: node.id.clone(),
                    provider_id: provider.id.clone(),
                };
                let has_slot = credentials
                    .slots
                    .iter()
                    .any(|s| s.providers.contains(&reference));
                if tunnel && !has_slot {
                    return Err(self.err(
                        format!("nodes[{i}].providers[{j}]"),
                        format!(
                            "node {:?} is managed (it has a recipient_key), so it rejects tunnels \
                             without a credential lease: serve \"{reference}\" by a credential slot",
                            node.id
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn client_keys(
        &self,
        raw: Vec<RawClientKey>,
        models: &[ModelSpec],
    ) -> Result<Vec<ClientKeySpec>, ConfigError> {
        let mut keys: Vec<ClientKeySpec> = Vec::with_capacity(raw.len());
        for (i, raw_key) in raw.into_iter().enumerate() {
            let key = format!("client_keys[{i}]");
            check_name(&raw_key.principal)
                .map_err(|why| self.err(format!("{key}.principal"), why))?;
            let is_lower_hex = raw_key
                .key_hash
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
            let key_hash = decode_hex::<32>(&raw_key.key_hash)
                .filter(|_| is_lower_hex)
                .ok_or_else(|| {
                    self.err(
                        format!("{key}.key_hash"),
                        "expected 64 lowercase hex digits (edge-bin keys hash-client-key prints it)",
                    )
                })?;
            if let Some(first) = keys.iter().position(|k| k.key_hash == key_hash) {
                return Err(self.err(
                    format!("{key}.key_hash"),
                    format!("the same key is also client_keys[{first}]"),
                ));
            }
            let (mut admin, mut metrics) = (false, false);
            for (j, scope) in raw_key.scopes.iter().enumerate() {
                match scope.as_str() {
                    ADMIN_SCOPE => admin = true,
                    METRICS_SCOPE => metrics = true,
                    _ => {
                        return Err(self.err(
                            format!("{key}.scopes[{j}]"),
                            format!(
                                "unknown scope {scope:?}; the scopes are \"{ADMIN_SCOPE}\" and \
                                 \"{METRICS_SCOPE}\""
                            ),
                        ))
                    }
                }
            }
            let positive = |field: &str, v: Option<u32>| match v {
                Some(0) => Err(self.err(
                    format!("{key}.{field}"),
                    "must be at least 1 (leave it out for no limit)",
                )),
                _ => Ok(v),
            };
            let limits = LimitSpec {
                max_concurrent: positive("max_concurrent", raw_key.max_concurrent)?,
                requests_per_minute: positive("requests_per_minute", raw_key.requests_per_minute)?,
                tokens_per_minute: positive("tokens_per_minute", raw_key.tokens_per_minute)?,
            };
            let positive_u64 = |field: &str, v: Option<u64>| match v {
                Some(0) => Err(self.err(
                    format!("{key}.{field}"),
                    "must be at least 1 (leave it out for no budget)",
                )),
                _ => Ok(v),
            };
            let budgets = BudgetSpec {
                tokens_per_day: positive_u64("tokens_per_day", raw_key.tokens_per_day)?,
                tokens_per_month: positive_u64("tokens_per_month", raw_key.tokens_per_month)?,
            };
            if !limits.is_unlimited() || !budgets.is_unlimited() {
                if let Some(first) = keys.iter().position(|k| {
                    k.principal == raw_key.principal
                        && !(k.limits.is_unlimited() && k.budgets.is_unlimited())
                }) {
                    return Err(self.err(
                        key.clone(),
                        format!(
                            "principal {:?} already has limits from client_keys[{first}]; \
                             set them on one of its keys",
                            raw_key.principal
                        ),
                    ));
                }
            }
            if let Some(allowed) = &raw_key.models {
                for (j, name) in allowed.iter().enumerate() {
                    if !models.iter().any(|m| &m.name == name) {
                        return Err(self.err(
                            format!("{key}.models[{j}]"),
                            format!("no [[models]] entry is named {name:?}"),
                        ));
                    }
                }
            }
            let priority = match &raw_key.priority {
                None => DEFAULT_PRIORITY,
                Some(RawPriority::Name(name)) => priority_class(name)
                    .filter(|_| name.parse::<u8>().is_err())
                    .ok_or_else(|| {
                        self.err(
                            format!("{key}.priority"),
                            format!(
                                "unknown class {name:?}; the classes are \"interactive\" (90), \
                                 \"standard\" (50) and \"batch\" (10), or a number from 0 to \
                                 {MAX_PRIORITY}"
                            ),
                        )
                    })?,
                Some(RawPriority::Number(n)) => in_range(*n, 0, u64::from(MAX_PRIORITY))
                    .map(|n| n as u8)
                    .map_err(|why| self.err(format!("{key}.priority"), why))?,
            };
            let weight = match raw_key.weight {
                None => 1,
                Some(w) => in_range(w, 1, u64::from(MAX_WEIGHT))
                    .map(|w| w as u32)
                    .map_err(|why| self.err(format!("{key}.weight"), why))?,
            };
            keys.push(ClientKeySpec {
                principal: raw_key.principal,
                key_hash,
                admin,
                metrics,
                limits,
                budgets,
                models: raw_key.models,
                priority,
                weight,
            });
        }
        Ok(keys)
    }

    /// Resolves `"<node id>/<provider id>"` against the configured nodes.
    fn provider_ref(
        &self,
        key: &str,
        text: &str,
        nodes: &[NodeSpec],
    ) -> Result<ProviderRef, ConfigError> {
        let Some((node_id, provider_id)) = text.split_once('/') else {
            return Err(self.err(
                key,
                format!("{text:?}: expected \"<node id>/<provider id>\""),
            ));
        };
        let Some(node) = nodes.iter().find(|n| n.id == node_id) else {
            return Err(self.err(key, format!("{text:?}: no node {node_id:?} is configured")));
        };
        if node.provider(provider_id).is_none() {
            return Err(self.err(
                key,
                format!("{text:?}: node {node_id:?} has no provider {provider_id:?}"),
            ));
        }
        Ok(ProviderRef {
            node_id: node_id.to_owned(),
            provider_id: provider_id.to_owned(),
        })
    }

    fn edge(&self, raw: RawEdge) -> Result<EdgeSettings, ConfigError> {
        check_name(&raw.name).map_err(|why| self.err("edge.name", why))?;
        check_trust_domain(&raw.trust_domain).map_err(|why| self.err("edge.trust_domain", why))?;
        let client_listen = parse_socket_addr(&raw.client_listen)
            .map_err(|why| self.err("edge.client_listen", why))?;
        let node_listen =
            parse_socket_addr(&raw.node_listen).map_err(|why| self.err("edge.node_listen", why))?;
        if client_listen == node_listen && client_listen.port() != 0 {
            return Err(self.err(
                "edge.node_listen",
                format!("{node_listen} is also edge.client_listen"),
            ));
        }
        let max_frame_bytes = match raw.max_frame_bytes {
            None => DEFAULT_MAX_FRAME_BYTES,
            Some(v) => in_range(v, MIN_FRAME_BYTES as u64, MAX_FRAME_BYTES_LIMIT as u64)
                .map(|v| v as usize)
                .map_err(|why| self.err("edge.max_frame_bytes", why))?,
        };
        let body_limit = max_frame_bytes - FRAME_HEADROOM_BYTES;
        let max_request_body_bytes = match raw.max_request_body_bytes {
            None => DEFAULT_MAX_REQUEST_BODY_BYTES,
            Some(v) => in_range(v, 1, body_limit as u64)
                .map(|v| v as usize)
                .map_err(|why| self.err("edge.max_request_body_bytes", why))?,
        };
        if max_request_body_bytes > body_limit {
            // Only reachable with the default body limit and a small frame limit.
            return Err(self.err(
                "edge.max_request_body_bytes",
                format!(
                    "the default {max_request_body_bytes} does not fit edge.max_frame_bytes \
                     {max_frame_bytes} minus {FRAME_HEADROOM_BYTES} bytes of headroom; set it to at most {body_limit}"
                ),
            ));
        }
        let max_upload_body_bytes = match raw.max_upload_body_bytes {
            None => DEFAULT_MAX_UPLOAD_BODY_BYTES,
            Some(v) => in_range(v, 1, MAX_UPLOAD_BODY_BYTES_LIMIT)
                .map_err(|why| self.err("edge.max_upload_body_bytes", why))?,
        };
        let drain_grace_ms = match raw.drain_grace_ms {
            None => DEFAULT_DRAIN_GRACE_MS,
            Some(v) => in_range(v, 0, MAX_DRAIN_GRACE_MS)
                .map_err(|why| self.err("edge.drain_grace_ms", why))?,
        };
        let flow_window_bytes = match raw.flow_window_bytes {
            None => DEFAULT_FLOW_WINDOW_BYTES,
            Some(v) => in_range(v, iop_wire::flow::MIN_WINDOW_BYTES, MAX_FLOW_WINDOW_BYTES)
                .map_err(|why| self.err("edge.flow_window_bytes", why))?,
        };
        let client_write_stall_timeout_ms = match raw.client_write_stall_timeout_ms {
            None => DEFAULT_CLIENT_WRITE_STALL_TIMEOUT_MS,
            Some(v) => in_range(
                v,
                MIN_CLIENT_WRITE_STALL_TIMEOUT_MS,
                MAX_CLIENT_WRITE_STALL_TIMEOUT_MS,
            )
            .map_err(|why| self.err("edge.client_write_stall_timeout_ms", why))?,
        };
        let response_wait_timeout_ms = match raw.response_wait_timeout_ms {
            None => DEFAULT_RESPONSE_WAIT_TIMEOUT_MS,
            Some(v) => in_range(
                v,
                MIN_RESPONSE_WAIT_TIMEOUT_MS,
                MAX_RESPONSE_WAIT_TIMEOUT_MS,
            )
            .map_err(|why| self.err("edge.response_wait_timeout_ms", why))?,
        };
        let metrics_access = match raw.metrics_access.as_deref() {
            None | Some("open") => MetricsAccess::Open,
            Some("key") => MetricsAccess::Key,
            Some(other) => {
                return Err(self.err(
                    "edge.metrics_access",
                    format!("expected \"open\" or \"key\" (got {other:?})"),
                ))
            }
        };
        let node_metrics_max_age_ms = match raw.node_metrics_max_age_ms {
            None => DEFAULT_NODE_METRICS_MAX_AGE_MS,
            Some(v) => in_range(v, 0, MAX_NODE_METRICS_MAX_AGE_MS)
                .map_err(|why| self.err("edge.node_metrics_max_age_ms", why))?,
        };
        use front_door::*;
        let limit = |value: Option<i64>, key: &str, default: u64, min: u64, max: u64| match value {
            None => Ok(default),
            Some(v) => in_range(v, min, max).map_err(|why| self.err(format!("edge.{key}"), why)),
        };
        let limits = ListenerLimits {
            client_head_timeout_ms: limit(
                raw.client_head_timeout_ms,
                "client_head_timeout_ms",
                CLIENT_HEAD_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            client_body_idle_timeout_ms: limit(
                raw.client_body_idle_timeout_ms,
                "client_body_idle_timeout_ms",
                CLIENT_BODY_IDLE_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            client_body_grace_ms: limit(
                raw.client_body_grace_ms,
                "client_body_grace_ms",
                CLIENT_BODY_GRACE_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            client_body_min_rate_bytes_per_sec: limit(
                raw.client_body_min_rate_bytes_per_sec,
                "client_body_min_rate_bytes_per_sec",
                CLIENT_BODY_MIN_RATE_BYTES_PER_SEC,
                0,
                MAX_BODY_RATE_LIMIT,
            )?,
            client_keep_alive_timeout_ms: limit(
                raw.client_keep_alive_timeout_ms,
                "client_keep_alive_timeout_ms",
                CLIENT_KEEP_ALIVE_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            max_client_connections: limit(
                raw.max_client_connections,
                "max_client_connections",
                MAX_CLIENT_CONNECTIONS,
                1,
                MAX_CONNECTIONS_LIMIT,
            )?,
            max_client_connections_per_peer: limit(
                raw.max_client_connections_per_peer,
                "max_client_connections_per_peer",
                MAX_CLIENT_CONNECTIONS_PER_PEER,
                1,
                MAX_CONNECTIONS_LIMIT,
            )?,
            client_linger_time_ms: limit(
                raw.client_linger_time_ms,
                "client_linger_time_ms",
                CLIENT_LINGER_TIME_MS,
                0,
                MAX_TIMEOUT_MS,
            )?,
            client_linger_idle_timeout_ms: limit(
                raw.client_linger_idle_timeout_ms,
                "client_linger_idle_timeout_ms",
                CLIENT_LINGER_IDLE_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            client_linger_max_bytes: limit(
                raw.client_linger_max_bytes,
                "client_linger_max_bytes",
                CLIENT_LINGER_MAX_BYTES,
                0,
                MAX_LINGER_BYTES_LIMIT,
            )?,
            node_handshake_timeout_ms: limit(
                raw.node_handshake_timeout_ms,
                "node_handshake_timeout_ms",
                NODE_HANDSHAKE_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            max_node_handshakes: limit(
                raw.max_node_handshakes,
                "max_node_handshakes",
                MAX_NODE_HANDSHAKES,
                1,
                MAX_CONNECTIONS_LIMIT,
            )?,
            max_node_handshakes_per_peer: limit(
                raw.max_node_handshakes_per_peer,
                "max_node_handshakes_per_peer",
                MAX_NODE_HANDSHAKES_PER_PEER,
                1,
                MAX_CONNECTIONS_LIMIT,
            )?,
            node_first_byte_timeout_ms: limit(
                raw.node_first_byte_timeout_ms,
                "node_first_byte_timeout_ms",
                NODE_FIRST_BYTE_TIMEOUT_MS,
                1,
                MAX_TIMEOUT_MS,
            )?,
            max_json_depth: limit(
                raw.max_json_depth,
                "max_json_depth",
                MAX_JSON_DEPTH,
                1,
                MAX_JSON_DEPTH_LIMIT,
            )?,
            max_json_elements: limit(
                raw.max_json_elements,
                "max_json_elements",
                MAX_JSON_ELEMENTS,
                1,
                MAX_JSON_ELEMENTS_LIMIT,
            )?,
            max_json_members: limit(
                raw.max_json_members,
                "max_json_members",
                MAX_JSON_MEMBERS,
                1,
                MAX_JSON_ELEMENTS_LIMIT,
            )?,
        };
        Ok(EdgeSettings {
            name: raw.name,
            trust_domain: raw.trust_domain,
            client_listen,
            node_listen,
            max_request_body_bytes,
            max_upload_body_bytes,
            max_frame_bytes,
            insecure_plaintext_nodes: raw.insecure_plaintext_nodes,
            allow_anonymous: raw.allow_anonymous,
            metrics_access,
            node_metrics_max_age_ms,
            drain_grace_ms,
            flow_window_bytes,
            client_write_stall_timeout_ms,
            response_wait_timeout_ms,
            limits,
        })
    }

    fn node(&self, i: usize, raw: RawNode) -> Result<NodeSpec, ConfigError> {
        check_name(&raw.id).map_err(|why| self.err(format!("nodes[{i}].id"), why))?;
        let mut adapters: Vec<AdapterSpec> = Vec::with_capacity(raw.adapters.len());
        for (j, raw_adapter) in raw.adapters.into_iter().enumerate() {
            let adapter = self.adapter(&format!("nodes[{i}].adapters[{j}]"), raw_adapter)?;
            if let Some(first) = adapters.iter().position(|a| a.name == adapter.name) {
                return Err(self.err(
                    format!("nodes[{i}].adapters[{j}].name"),
                    format!(
                        "duplicate adapter name {:?} on node {:?} (also nodes[{i}].adapters[{first}])",
                        adapter.name, raw.id
                    ),
                ));
            }
            adapters.push(adapter);
        }
        let mut providers: Vec<ProviderSpec> = Vec::with_capacity(raw.providers.len());
        for (j, raw_provider) in raw.providers.into_iter().enumerate() {
            let key = format!("nodes[{i}].providers[{j}]");
            let provider = self.provider(&key, raw_provider)?;
            if let Some(first) = providers.iter().position(|p| p.id == provider.id) {
                return Err(self.err(
                    format!("{key}.id"),
                    format!(
                        "duplicate provider id {:?} on node {:?} (also nodes[{i}].providers[{first}])",
                        provider.id, raw.id
                    ),
                ));
            }
            if !adapters.iter().any(|a| a.name == provider.adapter) {
                return Err(self.err(
                    format!("{key}.adapter"),
                    format!(
                        "node {:?} has no adapter named {:?}",
                        raw.id, provider.adapter
                    ),
                ));
            }
            providers.push(provider);
        }
        let recipient_key = match raw.recipient_key {
            None => None,
            Some(text) => Some(
                parse_recipient_key(&text)
                    .map_err(|why| self.err(format!("nodes[{i}].recipient_key"), why))?,
            ),
        };
        Ok(NodeSpec {
            id: raw.id,
            adapters,
            providers,
            recipient_key,
        })
    }

    fn adapter(&self, key: &str, raw: RawAdapter) -> Result<AdapterSpec, ConfigError> {
        let kind = match (raw.kind.as_str(), raw.profile) {
            ("openai_compat", None) => AdapterKind::OpenAiCompat {
                profile: ProfileName::OpenAi,
            },
            ("openai_compat", Some(profile)) => AdapterKind::OpenAiCompat {
                profile: ProfileName::from_name(&profile).ok_or_else(|| {
                    self.err(
                        format!("{key}.profile"),
                        format!(
                            "unknown profile {profile:?}: expected \"openai\", \"vllm\", \"llama_cpp\" or \"sglang\""
                        ),
                    )
                })?,
            },
            ("ollama", None) => AdapterKind::Ollama,
            ("ollama", Some(_)) => {
                return Err(self.err(
                    format!("{key}.profile"),
                    "only an openai_compat adapter has a profile",
                ))
            }
            (other, _) => {
                return Err(self.err(
                    format!("{key}.kind"),
                    format!("unknown adapter kind {other:?}: expected \"openai_compat\" or \"ollama\""),
                ))
            }
        };
        let name = match raw.name {
            Some(name) => {
                check_name(&name).map_err(|why| self.err(format!("{key}.name"), why))?;
                name
            }
            None => kind.as_str().to_owned(),
        };
        let base_url = BaseUrl::parse(&raw.base_url)
            .map_err(|why| self.err(format!("{key}.base_url"), why))?;
        let insecure_skip_verify = raw.tls_insecure_skip_verify.unwrap_or(false);
        let ca_file = match raw.ca_file {
            None => None,
            Some(file) => Some(resolve_path(self.file, &format!("{key}.ca_file"), &file)?),
        };
        for (set, name) in [
            (ca_file.is_some(), "ca_file"),
            (
                raw.tls_insecure_skip_verify.is_some(),
                "tls_insecure_skip_verify",
            ),
        ] {
            if set && !base_url.is_tls() {
                return Err(self.err(
                    format!("{key}.{name}"),
                    "only an https:// base_url has provider TLS settings",
                ));
            }
        }
        if insecure_skip_verify && ca_file.is_some() {
            return Err(self.err(
                format!("{key}.tls_insecure_skip_verify"),
                "verifies nothing, so ca_file would be ignored: set one of them",
            ));
        }
        let tls = ProviderTlsSpec {
            ca_file,
            ca_pem: None,
            insecure_skip_verify,
        };
        let capacity = match raw.capacity {
            None => 0,
            Some(v) => in_range(v, 0, u64::from(MAX_CAPACITY))
                .map(|v| v as u32)
                .map_err(|why| self.err(format!("{key}.capacity"), why))?,
        };
        let health_path = match (raw.health_path, kind) {
            (None, _) => None,
            (Some(path), AdapterKind::OpenAiCompat { .. }) => {
                Some(check_path(&path).map_err(|why| self.err(format!("{key}.health_path"), why))?)
            }
            (Some(_), AdapterKind::Ollama) => {
                return Err(self.err(
                    format!("{key}.health_path"),
                    "only an openai_compat adapter has a health path (Ollama's is /api/tags)",
                ))
            }
        };
        Ok(AdapterSpec {
            name,
            kind,
            base_url,
            tls,
            capacity,
            health_path,
        })
    }

    fn provider(&self, key: &str, raw: RawProvider) -> Result<ProviderSpec, ConfigError> {
        check_name(&raw.id).map_err(|why| self.err(format!("{key}.id"), why))?;
        check_text(&raw.target).map_err(|why| self.err(format!("{key}.target"), why))?;
        let capacity = in_range(raw.capacity, 1, u64::from(MAX_CAPACITY))
            .map(|v| v as u32)
            .map_err(|why| self.err(format!("{key}.capacity"), why))?;
        let long_context_capacity = match raw.long_context_capacity {
            None => 0,
            Some(v) => in_range(v, 0, u64::from(capacity))
                .map(|v| v as u32)
                .map_err(|why| {
                    self.err(
                        format!("{key}.long_context_capacity"),
                        format!("{why} (it may not exceed capacity)"),
                    )
                })?,
        };
        let response_stall_timeout_ms = raw.response_stall_timeout_ms.unwrap_or(0);
        effective_stall_timeout(response_stall_timeout_ms).map_err(|e| {
            // The wire error leads with the field name; the key already says it.
            let reason = e.to_string();
            let reason = reason
                .strip_prefix("response_stall_timeout_ms")
                .map_or(reason.as_str(), str::trim_start);
            self.err(format!("{key}.response_stall_timeout_ms"), reason)
        })?;
        let category = match raw.category.as_deref() {
            None | Some("local_inference") => ProviderCategory::LocalInference,
            Some("api") => ProviderCategory::Api,
            Some(other) => {
                return Err(self.err(
                    format!("{key}.category"),
                    format!("unknown category {other:?}: expected \"api\" or \"local_inference\""),
                ))
            }
        };
        Ok(ProviderSpec {
            id: raw.id,
            adapter: raw.adapter,
            target: raw.target,
            capacity,
            long_context_capacity,
            response_stall_timeout_ms,
            category,
            enabled: raw.enabled.unwrap_or(true),
        })
    }

    fn model(&self, i: usize, raw: RawModel, nodes: &[NodeSpec]) -> Result<ModelSpec, ConfigError> {
        let key = format!("models[{i}]");
        check_text(&raw.name).map_err(|why| self.err(format!("{key}.name"), why))?;
        if raw.providers.is_empty() && raw.allow_no_providers != Some(true) {
            return Err(self.err(
                format!("{key}.providers"),
                "must list at least one provider (allow_no_providers = true serves the \
                 model with none: every request gets 503 no_provider_available)",
            ));
        }
        let mut providers: Vec<ProviderRef> = Vec::with_capacity(raw.providers.len());
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (j, text) in raw.providers.iter().enumerate() {
            let pkey = format!("{key}.providers[{j}]");
            if let Some(first) = seen.insert(text.as_str(), j) {
                return Err(self.err(
                    pkey,
                    format!("{text:?} is listed twice (also {key}.providers[{first}])"),
                ));
            }
            providers.push(self.provider_ref(&pkey, text, nodes)?);
        }
        let long_context_threshold_tokens = match raw.long_context_threshold_tokens {
            None => None,
            Some(v) => Some(
                in_range(v, 1, MAX_LONG_CONTEXT_THRESHOLD_TOKENS)
                    .map_err(|why| self.err(format!("{key}.long_context_threshold_tokens"), why))?,
            ),
        };
        let max_queue = match raw.max_queue {
            None => DEFAULT_MAX_QUEUE,
            Some(v) => in_range(v, 1, u64::from(MAX_QUEUE_LIMIT))
                .map(|v| v as u32)
                .map_err(|why| self.err(format!("{key}.max_queue"), why))?,
        };
        let queue_timeout_ms = match raw.queue_timeout_ms {
            None => DEFAULT_QUEUE_TIMEOUT_MS,
            Some(v) => in_range(v, 1, MAX_QUEUE_TIMEOUT_MS)
                .map_err(|why| self.err(format!("{key}.queue_timeout_ms"), why))?,
        };
        let max_attempts = match raw.max_attempts {
            None => DEFAULT_MAX_ATTEMPTS,
            Some(v) => in_range(v, 1, u64::from(MAX_ATTEMPTS_LIMIT))
                .map(|v| v as u32)
                .map_err(|why| self.err(format!("{key}.max_attempts"), why))?,
        };
        let owned_by = match raw.owned_by {
            None => DEFAULT_OWNED_BY.to_owned(),
            Some(owned_by) => {
                check_text(&owned_by).map_err(|why| self.err(format!("{key}.owned_by"), why))?;
                owned_by
            }
        };
        let routing = match raw.routing.as_deref() {
            // Clients send no hint: a pool of OpenAI-compatible servers
            // (whose engines keep prefix caches) routes by prompt prefix.
            None => {
                let compatible = providers
                    .iter()
                    .filter(|r| {
                        nodes.iter().any(|n| {
                            n.id == r.node_id
                                && n.provider(&r.provider_id)
                                    .and_then(|p| n.adapter(&p.adapter))
                                    .is_some_and(|a| a.kind != AdapterKind::Ollama)
                        })
                    })
                    .count();
                if compatible >= 2 {
                    RoutingPolicy::Prefix
                } else {
                    RoutingPolicy::LeastLoaded
                }
            }
            Some(text) => RoutingPolicy::parse(text).ok_or_else(|| {
                self.err(
                    format!("{key}.routing"),
                    format!("{text:?}: expected \"least_loaded\", \"session\" or \"prefix\""),
                )
            })?,
        };
        Ok(ModelSpec {
            name: raw.name,
            providers,
            long_context_threshold_tokens,
            max_queue,
            queue_timeout_ms,
            max_attempts,
            owned_by,
            routing,
        })
    }
}
