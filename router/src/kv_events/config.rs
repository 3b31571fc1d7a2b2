//! `--kv-events-config`: vLLM's `KVEventsConfig` as JSON, with vLLM's keys,
//! defaults and meaning, so a deployment's vLLM setting works unchanged.
//! Unknown keys and bad values are errors at startup.

use serde::{Deserialize, Serialize};

/// Where events go: nowhere (`null`) or a ZeroMQ PUB socket (`zmq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PublisherKind {
    Null,
    Zmq,
}

/// vLLM's KV events settings (vllm/config/kv_events.py).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// Publish at all (vLLM publishes nothing unless this is true).
    pub enable_kv_cache_events: bool,
    /// Unset: `zmq` when enabled, else `null`.
    pub publisher: Option<PublisherKind>,
    /// PUB socket: bound when it has `*` or `::` as host or is `ipc://`, else connected.
    pub endpoint: String,
    /// ROUTER socket answering replay requests (always bound); none: no replay.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Accepted for compatibility: the socket queues up to 100,000 messages per subscriber.
    pub hwm: u64,
    /// Batches waiting for the publisher before the oldest news is given up (and
    /// an `AllBlocksCleared` tells subscribers to forget what they knew).
    pub max_queue_size: usize,
    /// First frame of every message; subscribers filter on its prefix.
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Parses and checks vLLM's JSON.
    pub fn parse(json: &str) -> Result<Self, String> {
        let mut de = serde_json::Deserializer::from_str(json);
        let c: Self = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let at = e.path().to_string();
            let at = if at == "." { String::new() } else { format!("{at}: ") };
            format!("--kv-events-config: {at}{}", e.into_inner())
        })?;
        de.end().map_err(|e| format!("--kv-events-config: {e}"))?;
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<(), String> {
        check_endpoint("endpoint", &self.endpoint)?;
        if let Some(r) = &self.replay_endpoint {
            check_endpoint("replay_endpoint", r)?;
            if *r == self.endpoint {
                return Err("--kv-events-config: replay_endpoint must differ from endpoint".into());
            }
        }
        for (name, v) in [("buffer_steps", self.buffer_steps), ("max_queue_size", self.max_queue_size)] {
            if v == 0 {
                return Err(format!("--kv-events-config: {name} must be at least 1"));
            }
        }
        if self.hwm == 0 {
            return Err("--kv-events-config: hwm must be at least 1".into());
        }
        Ok(())
    }

    /// Whether events are published (vLLM's rule: enabled, and not the null publisher).
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher != Some(PublisherKind::Null)
    }
}

/// `tcp://host:port` or `ipc://path`; vLLM's `inproc://` needs vLLM's own process.
fn check_endpoint(name: &str, e: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("--kv-events-config: {name} {e:?} {why}"));
    if let Some(rest) = e.strip_prefix("tcp://") {
        let Some((host, port)) = rest.rsplit_once(':') else { return bad("has no port") };
        if host.is_empty() || port.parse::<u16>().is_err() {
            return bad("is not tcp://HOST:PORT");
        }
        return Ok(());
    }
    if e.strip_prefix("ipc://").is_some_and(|p| !p.is_empty()) {
        return Ok(());
    }
    bad("is neither tcp://HOST:PORT nor ipc://PATH")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_json_parses_with_vllm_defaults() {
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:5558", "topic": "kv@pod@model"}"#,
        )
        .unwrap();
        assert!(c.publishes());
        assert_eq!((c.buffer_steps, c.hwm, c.max_queue_size), (10_000, 100_000, 100_000));
        assert_eq!(c.topic, "kv@pod@model");
        // As in vLLM: not enabled publishes nothing, whatever the publisher.
        assert!(!KvEventsConfig::parse(r#"{"publisher": "zmq"}"#).unwrap().publishes());
        let null = r#"{"enable_kv_cache_events": true, "publisher": "null"}"#;
        assert!(!KvEventsConfig::parse(null).unwrap().publishes());
        assert!(KvEventsConfig::parse(r#"{"enable_kv_cache_events": true}"#).unwrap().publishes());
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors() {
        let err = |j: &str| KvEventsConfig::parse(j).unwrap_err();
        assert!(err(r#"{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}"#).contains("unknown field `endpont`"));
        assert!(err(r#"{"publisher": "kafka"}"#).contains("unknown variant `kafka`"));
        assert!(err(r#"{"buffer_steps": -1}"#).contains("buffer_steps"));
        assert!(err(r#"{"buffer_steps": 0}"#).contains("buffer_steps must be at least 1"));
        assert!(err(r#"{"endpoint": "inproc://x"}"#).contains("neither"));
        assert!(err(r#"{"endpoint": "tcp://*:port"}"#).contains("not tcp://HOST:PORT"));
        assert!(err(r#"{"replay_endpoint": "tcp://*:5557"}"#).contains("must differ"));
        assert!(err("[1]").contains("--kv-events-config"));
    }
}
