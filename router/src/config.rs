//! Router configuration: the one declaration of every router option (flag,
//! default, help). clap parses `pagemill router`'s argv into it, and the
//! Python CLI builds `pagemill launch`'s router options from [`option_table`]
//! (python.rs), so an option is written here and nowhere else.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgAction, CommandFactory, FromArgMatches, Parser};

use crate::client::{ShardAddr, ShardAuth};

/// Help heading of the options `pagemill launch` sets itself per server
/// (sockets, model directory): the launcher hides them from its own CLI.
pub const LAUNCHER_SETS: &str = "Set by pagemill launch";

#[derive(Debug, Clone, Parser, serde::Serialize)]
// allow_negative_numbers: `--port -1` is a bad value of --port, not an unknown flag `-1`.
// args_override_self: the last of a repeated option wins, as in the Python CLI.
#[command(name = "pagemill router", about = "Run the HTTP router (started by pagemill launch)")]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub struct RouterConfig {
    /// address the HTTP API listens on
    #[arg(long, default_value = "127.0.0.1")]
    pub hostname: String,
    /// TCP port of the HTTP API
    #[arg(long, default_value_t = 3000)]
    pub port: u16,
    /// unix socket of one shard of the tensor-parallel group, once per shard in rank order
    #[arg(long = "shard-uds-path", value_name = "PATH", help_heading = LAUNCHER_SETS)]
    pub shard_uds_paths: Vec<PathBuf>,
    /// one data-parallel shard group: its shards in rank order, comma-separated, each a unix
    /// socket path or host:port (`pagemill shard --listen`); once per group (instead of --shard-uds-path)
    #[arg(long = "shard-group", value_name = "SHARDS", help_heading = LAUNCHER_SETS)]
    pub shard_groups: Vec<String>,
    /// file holding the token sent on every call to the shards (they must be started with the same
    /// --shard-auth-token-file); required when a shard is reached over TCP
    #[arg(long, value_name = "PATH")]
    pub shard_auth_token_file: Option<PathBuf>,
    /// how a request's shard group is chosen: the longest cached prefix balanced against load
    /// (prefix), the fewest queued and running tokens (least-load), or in turn (round-robin)
    #[arg(long, value_enum, default_value_t = crate::routing::Routing::Prefix)]
    pub routing: crate::routing::Routing,
    /// directory holding tokenizer.json (the model directory)
    // Parsed leniently so that the empty default (RouterConfig::default) parses; check() rejects it.
    #[arg(long, default_value = "", value_parser = any_path, help_heading = LAUNCHER_SETS)]
    pub tokenizer_dir: PathBuf,
    /// model name reported by the API
    #[arg(long, default_value = "", help_heading = LAUNCHER_SETS)]
    pub model_id: String,
    /// longest prompt of one request, in tokens
    #[arg(long, default_value_t = 1024)]
    pub max_input_tokens: u32,
    /// longest prompt + new tokens of one request
    #[arg(long, default_value_t = 2048)]
    pub max_total_tokens: u32,
    /// prompt tokens computed in one prefill step
    #[arg(long, default_value_t = 4096)]
    pub max_batch_prefill_tokens: u32,
    /// chunked prefill: at most N prompt tokens per step, long prompts split
    /// across steps with decode steps in between (0: off)
    // `::std::option::Option` opts out of clap's Option handling: the parser maps 0 to None.
    #[arg(long, value_name = "N", default_value = "0", value_parser = zero_is_off)]
    pub prefill_chunk_tokens: ::std::option::Option<u32>,
    /// mixed steps: each step computes every running sequence's decode token plus
    /// prompt chunks, up to N tokens in all (0: a step is either a prefill or a decode)
    // 2048: measured against separate steps at 64 concurrent on the default
    // model (docs/benchmarks.md): same throughput, TTFT p50 -27%, p99 no worse.
    #[arg(long, value_name = "N", default_value = "2048", value_parser = zero_is_off)]
    pub max_num_batched_tokens: ::std::option::Option<u32>,
    /// token budget (prompt + max_new_tokens) of the running batch
    /// (default: what the KV pool holds)
    #[arg(long)]
    pub max_batch_total_tokens: Option<u32>,
    /// sequences per decode step
    #[arg(long, default_value_t = 256)]
    pub max_batch_size: u32,
    /// requests in flight; past this, new ones get 429 at once
    #[arg(long, default_value_t = 128)]
    pub max_concurrent_requests: u32,
    /// stop sequences of one request
    #[arg(long, default_value_t = 16)]
    pub max_stop_sequences: u32,
    /// alternatives per token a request may ask for (`top_n_tokens`)
    #[arg(long, default_value_t = 5)]
    pub max_top_n_tokens: u32,
    /// new tokens of a request that does not say
    #[arg(long, default_value_t = 100)]
    pub default_max_new_tokens: u32,
    /// largest request body, e.g. 2MB, 512KiB or bytes
    #[arg(long, default_value = "2MB", value_parser = parse_bytes)]
    pub payload_limit: usize,
    /// threads that tokenize and validate requests
    #[arg(long, default_value_t = 2)]
    pub validation_workers: usize,
    /// seconds SIGTERM waits for accepted requests to finish (new ones get 503)
    #[arg(long = "shutdown-timeout", value_name = "SECONDS", default_value_t = 30)]
    pub shutdown_timeout_s: u64,
    /// a request still queued after this long gets 429 `queue_timeout` (0: wait forever)
    #[arg(long, default_value_t = 120_000)]
    pub max_queue_wait_ms: u64,
    /// do not reuse KV blocks of shared prompt prefixes
    #[arg(long = "no-prefix-caching", action = ArgAction::SetFalse)]
    pub prefix_caching: bool,
    /// admit the queued request with the longest cached prefix first (SGLang's LPM)
    #[arg(long)]
    pub cache_aware_admission: bool,
    /// send the next decode step while the shard still computes the current one at every batch
    /// size, hiding the router's work and the gRPC round trip between two steps. Without it the
    /// router does so from 16 sequences: below, on a 2-core CPU the work it overlaps takes cores
    /// from the forward (int8 batch-1 decode got slower; docs/architecture.md)
    #[arg(long, conflicts_with = "no_schedule_ahead")]
    pub schedule_ahead: bool,
    /// never send a decode step before the reply of the one in flight
    #[arg(long)]
    pub no_schedule_ahead: bool,
    /// a queued request's `priority` improves by one per this many ms waited: only better-priority
    /// requests arriving within (priority gap) x this after it can overtake it (0: no aging)
    #[arg(long, default_value_t = 1000)]
    pub priority_aging_ms: u64,
    /// most sequences one tenant (the request's `user`) may have running at once, so that one
    /// client cannot take the whole batch (0: no cap)
    #[arg(long, default_value_t = 0)]
    pub max_running_per_tenant: u32,
    /// require `Authorization: Bearer <key>` on generation routes
    // Read from the environment too: the launcher passes the key there, not in argv, where any
    // local user could read it with `ps`.
    #[arg(long, env = API_KEY_ENV, hide_env_values = true)]
    pub api_key: Option<String>,
    /// format of the model's tool calls on the chat routes (default: inferred from the chat template)
    #[arg(long, value_enum)]
    pub tool_call_parser: Option<crate::tools::ToolCallParser>,
    /// split the reasoning block of reasoning models into `reasoning_content` (`think`: <think>...</think>)
    #[arg(long, value_enum)]
    pub reasoning_parser: Option<crate::reasoning::ReasoningParser>,
    /// largest `n` (OpenAI) / `best_of` (TGI) of one request
    #[arg(long, default_value_t = 4)]
    pub max_best_of: u32,
    /// publish KV-cache events in vLLM's format for routers and gateways in front of several servers
    /// (vllm-router's kv_aware policy, llm-d): vLLM's KVEventsConfig as JSON, e.g.
    /// '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
    /// "replay_endpoint": "tcp://*:5558", "topic": "kv"}' (docs/kv_cache.md)
    #[arg(long, value_name = "JSON", value_parser = crate::kv_events::KvEventsConfig::parse)]
    pub kv_events_config: Option<crate::kv_events::KvEventsConfig>,
    /// how the events in a KV event batch are encoded: maps tagged under "type" (map: vLLM now, as
    /// vllm-router reads them) or arrays led by the tag (array: vLLM before, as llm-d's indexer reads them)
    #[arg(long, value_enum, default_value_t = crate::kv_events::Layout::Map)]
    pub kv_events_layout: crate::kv_events::Layout,
    /// serve LoRA adapters (PEFT directories: adapter_config.json + adapter_model.safetensors), chosen per
    /// request by `model` (OpenAI, Anthropic) or `adapter_id` (TGI); loaded at launch (--lora-modules) or
    /// by POST /v1/load_lora_adapter (docs/lora.md)
    #[arg(long)]
    pub enable_lora: bool,
    /// adapters served from launch: name=path, or vLLM's JSON '{"name": ..., "path": ...}'; several after
    /// one flag or the flag repeated (needs --enable-lora)
    #[arg(long, value_name = "NAME=PATH", num_args = 1.., value_parser = crate::lora::LoraModule::parse)]
    pub lora_modules: Vec<crate::lora::LoraModule>,
    /// adapters the shards hold at once (each reserves room for one of --max-lora-rank), and the most
    /// distinct adapters one step runs: a request whose adapter cannot join waits, the others go ahead
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub max_loras: u32,
    /// largest rank of an adapter (1 to 64); a larger one is refused when it is loaded
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub max_lora_rank: u32,
    /// level of the router's log: error, warn, info, debug or trace
    #[arg(long, default_value = "info")]
    pub log_level: String,
}

pub const API_KEY_ENV: &str = "PAGEMILL_API_KEY";

impl Default for RouterConfig {
    /// The declared defaults, whatever the environment says.
    fn default() -> Self {
        let cmd = Self::command().mut_arg("api_key", |a| a.env(None));
        let matches = cmd.get_matches_from(["pagemill-router"]);
        Self::from_arg_matches(&matches).expect("the declared defaults parse")
    }
}

impl RouterConfig {
    /// Parses `argv` (program name first). An empty `$PAGEMILL_API_KEY` means no key,
    /// as an unset one does; an empty `--api-key ""` is an error (check()).
    pub fn from_argv<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let matches = Self::command().try_get_matches_from(argv)?;
        let mut config = Self::from_arg_matches(&matches)?;
        if matches.value_source("api_key") == Some(ValueSource::EnvVariable) && config.api_key.as_deref() == Some("") {
            config.api_key = None;
        }
        Ok(config)
    }

    /// The shard groups: each --shard-group, or the --shard-uds-path sockets as one group.
    pub fn groups(&self) -> Vec<Vec<ShardAddr>> {
        if self.shard_groups.is_empty() {
            return vec![self.shard_uds_paths.iter().map(|p| ShardAddr::Unix(p.clone())).collect()];
        }
        self.shard_groups
            .iter()
            .map(|g| g.split(',').map(str::trim).filter(|p| !p.is_empty()).map(ShardAddr::parse).collect())
            .collect()
    }

    /// The credential for the shards: the token file's first line, if one is given.
    pub fn shard_auth(&self) -> Result<ShardAuth, String> {
        let Some(path) = &self.shard_auth_token_file else { return Ok(ShardAuth::default()) };
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let token = text.lines().next().unwrap_or("").trim();
        if token.is_empty() {
            return Err(format!("{} holds no token", path.display()));
        }
        ShardAuth::token(token)
    }

    pub fn check(&self) -> Result<(), String> {
        if self.shard_uds_paths.is_empty() && self.shard_groups.is_empty() {
            return Err("at least one shard socket is required (--shard-uds-path or --shard-group)".into());
        }
        if !self.shard_uds_paths.is_empty() && !self.shard_groups.is_empty() {
            return Err("give the shards either as --shard-uds-path (one group) or as --shard-group, not both".into());
        }
        let groups = self.groups();
        if groups.iter().any(|g| g.is_empty()) {
            return Err("a --shard-group lists no shard".into());
        }
        if groups.iter().any(|g| g.len() != groups[0].len()) {
            return Err("every --shard-group must have as many shards (ranks) as the first".into());
        }
        let tcp = groups.iter().flatten().any(|a| matches!(a, ShardAddr::Tcp(_)));
        if tcp && self.shard_auth_token_file.is_none() {
            return Err("shards reached over TCP need --shard-auth-token-file (the same token the shards check)".into());
        }
        if self.tokenizer_dir.as_os_str().is_empty() {
            return Err("the model directory is required (--tokenizer-dir)".into());
        }
        if self.max_input_tokens >= self.max_total_tokens {
            return Err(format!(
                "max_input_tokens ({}) must be < max_total_tokens ({})",
                self.max_input_tokens, self.max_total_tokens
            ));
        }
        if self.max_batch_prefill_tokens < self.max_input_tokens {
            return Err(format!(
                "max_batch_prefill_tokens ({}) must be >= max_input_tokens ({})",
                self.max_batch_prefill_tokens, self.max_input_tokens
            ));
        }
        if self.prefill_chunk_tokens == Some(0) {
            return Err("prefill_chunk_tokens must be positive (leave it unset to disable chunked prefill)".into());
        }
        if self.max_num_batched_tokens == Some(0) {
            return Err(
                "max_num_batched_tokens must be positive (leave it unset for separate prefill and decode steps)".into(),
            );
        }
        if self.max_best_of == 0 {
            return Err("max_best_of must be positive".into());
        }
        if self.api_key.as_deref() == Some("") {
            return Err("api_key must not be empty (leave it unset to disable authentication)".into());
        }
        if !self.enable_lora && !self.lora_modules.is_empty() {
            return Err("--lora-modules needs --enable-lora".into());
        }
        if self.max_batch_size == 0 || self.max_concurrent_requests == 0 {
            return Err("max_batch_size and max_concurrent_requests must be positive".into());
        }
        Ok(())
    }
}

/// One router option as the Python CLI needs it to offer and forward it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OptionInfo {
    /// RouterConfig's field name.
    pub dest: String,
    /// The flag, without the leading `--`.
    pub flag: String,
    /// "value" (takes one value), "append" (repeatable), "many" (one or more values, repeatable),
    /// "flag" (no value).
    pub kind: &'static str,
    pub value_name: Option<String>,
    /// As written on the command line; None where the option has no default.
    pub default: Option<String>,
    pub help: String,
    pub choices: Vec<String>,
    /// Environment variable read when the flag is absent.
    pub env: Option<String>,
    /// Set by `pagemill launch` itself (LAUNCHER_SETS).
    pub launcher_sets: bool,
}

/// Every router option, in declaration order.
pub fn option_table() -> Vec<OptionInfo> {
    let cmd = RouterConfig::command();
    cmd.get_arguments()
        .filter(|a| a.get_long().is_some() && !matches!(a.get_action(), ArgAction::Help | ArgAction::Version))
        .map(|a| OptionInfo {
            dest: a.get_id().to_string(),
            flag: a.get_long().unwrap_or_default().to_string(),
            kind: match a.get_action() {
                ArgAction::SetTrue | ArgAction::SetFalse => "flag",
                // Several values after one flag (`--lora-modules a=/x b=/y`), as well as repeated.
                ArgAction::Append if a.get_num_args().is_some_and(|n| n.max_values() > 1) => "many",
                ArgAction::Append => "append",
                _ => "value",
            },
            value_name: a.get_value_names().and_then(|v| v.first()).map(|v| v.to_string()),
            default: match a.get_action() {
                ArgAction::SetTrue | ArgAction::SetFalse => None,
                _ => a.get_default_values().first().map(|v| v.to_string_lossy().into_owned()),
            },
            help: a.get_help().map(|h| h.to_string()).unwrap_or_default(),
            choices: match a.get_action() {
                ArgAction::SetTrue | ArgAction::SetFalse => vec![], // clap's "true"/"false" are not typed by users
                // Aliases too: `--reasoning-parser qwen3` is as valid as `think`.
                _ => {
                    a.get_possible_values().iter().flat_map(|p| p.get_name_and_aliases().map(str::to_string)).collect()
                }
            },
            env: a.get_env().map(|e| e.to_string_lossy().into_owned()),
            launcher_sets: a.get_help_heading() == Some(LAUNCHER_SETS),
        })
        .collect()
}

fn any_path(s: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(s))
}

/// "0" means off: None.
fn zero_is_off(s: &str) -> Result<Option<u32>, String> {
    let n: u32 = s.parse().map_err(|e| format!("{e} (a token count; 0: off)"))?;
    Ok((n > 0).then_some(n))
}

/// "2MB", "512KiB", "1.5G", "1000000" -> bytes (decimal kb/mb/gb, binary k/m/g and kib/mib/gib).
pub fn parse_bytes(text: &str) -> Result<usize, String> {
    let s = text.trim().to_ascii_lowercase();
    let num = s.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let scale: f64 = match &s[num.len()..] {
        "" | "b" => 1.0,
        "k" | "kib" => (1u64 << 10) as f64,
        "kb" => 1e3,
        "m" | "mib" => (1u64 << 20) as f64,
        "mb" => 1e6,
        "g" | "gib" => (1u64 << 30) as f64,
        "gb" => 1e9,
        _ => return Err(format!("not a size: {text:?} (try 2MB, 512KiB)")),
    };
    match num.parse::<f64>() {
        Ok(n) if n >= 0.0 && n.is_finite() => Ok((n * scale) as usize),
        _ => Err(format!("not a size: {text:?} (try 2MB, 512KiB)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(flags: &[&str]) -> Result<RouterConfig, clap::Error> {
        RouterConfig::from_argv(std::iter::once("pagemill-router").chain(flags.iter().copied()))
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = RouterConfig::default();
        assert_eq!((c.hostname.as_str(), c.port), ("127.0.0.1", 3000));
        assert_eq!((c.max_input_tokens, c.max_total_tokens, c.max_batch_prefill_tokens), (1024, 2048, 4096));
        assert_eq!(
            (c.prefill_chunk_tokens, c.max_num_batched_tokens, c.max_batch_total_tokens),
            (None, Some(2048), None)
        );
        assert_eq!((c.max_batch_size, c.max_concurrent_requests, c.max_stop_sequences), (256, 128, 16));
        assert_eq!((c.max_top_n_tokens, c.default_max_new_tokens, c.max_best_of), (5, 100, 4));
        assert_eq!((c.payload_limit, c.validation_workers), (2_000_000, 2));
        assert_eq!((c.shutdown_timeout_s, c.max_queue_wait_ms), (30, 120_000));
        assert!(c.prefix_caching && !c.cache_aware_admission && !c.schedule_ahead && !c.no_schedule_ahead);
        assert_eq!((c.api_key, c.log_level.as_str()), (None, "info"));
        assert!(c.shard_uds_paths.is_empty() && c.tokenizer_dir.as_os_str().is_empty() && c.model_id.is_empty());
    }

    #[test]
    fn flags_set_fields() {
        let c = parse(&[
            "--shard-uds-path",
            "/s0",
            "--shard-uds-path",
            "/s1",
            "--tokenizer-dir",
            "/m",
            "--port",
            "8080",
            "--prefill-chunk-tokens",
            "512",
            "--max-num-batched-tokens",
            "0",
            "--max-batch-total-tokens",
            "9000",
            "--payload-limit",
            "512KiB",
            "--shutdown-timeout",
            "5",
            "--no-prefix-caching",
            "--cache-aware-admission",
            "--api-key",
            "k",
            "--log-level",
            "debug",
            "--schedule-ahead",
        ])
        .unwrap();
        assert_eq!(c.shard_uds_paths, [PathBuf::from("/s0"), PathBuf::from("/s1")]);
        assert_eq!((c.tokenizer_dir, c.port), (PathBuf::from("/m"), 8080));
        assert_eq!((c.prefill_chunk_tokens, c.max_num_batched_tokens), (Some(512), None));
        assert_eq!((c.max_batch_total_tokens, c.payload_limit, c.shutdown_timeout_s), (Some(9000), 512 << 10, 5));
        assert!(!c.prefix_caching && c.cache_aware_admission && c.schedule_ahead);
        assert_eq!((c.api_key.as_deref(), c.log_level.as_str()), (Some("k"), "debug"));
        let c = parse(&["--no-schedule-ahead"]).unwrap();
        assert!(c.no_schedule_ahead && !c.schedule_ahead);
        assert!(parse(&["--schedule-ahead", "--no-schedule-ahead"]).is_err(), "the two contradict each other");
        let argv = ["--shard-uds-path", "/s", "--tokenizer-dir", "/m"];
        assert_eq!(parse(&argv).unwrap().check(), Ok(()));
        // Repeated: the last value wins, a list collects, a flag may repeat.
        let c = parse(&[
            "--port",
            "1",
            "--port=2",
            "--shard-uds-path=/a",
            "--shard-uds-path=/b",
            "--no-prefix-caching",
            "--no-prefix-caching",
        ])
        .unwrap();
        assert_eq!((c.port, c.shard_uds_paths.len(), c.prefix_caching), (2, 2, false));
    }

    #[test]
    fn bad_values_are_errors_that_name_the_flag() {
        for (flags, needle) in [
            (&["--port", "70000"][..], "--port"),
            (&["--max-input-tokens", "-1"], "--max-input-tokens"),
            (&["--payload-limit", "2 parsecs"], "not a size"),
            (&["--prefill-chunk-tokens", "x"], "--prefill-chunk-tokens"),
            (&["--no-such-option"], "--no-such-option"),
            (&["--no-prefix-caching", "false"], "false"),
        ] {
            let err = parse(flags).unwrap_err().to_string();
            assert!(err.contains(needle), "{flags:?}: {err}");
        }
        assert!(RouterConfig::default().check().unwrap_err().contains("--shard-uds-path"));
    }

    #[test]
    fn shard_groups_parse_and_tcp_needs_a_token() {
        let c = parse(&[
            "--tokenizer-dir",
            "/m",
            "--shard-group",
            "/a0,/a1",
            "--shard-group",
            "/b0, /b1",
            "--routing",
            "least-load",
        ])
        .unwrap();
        assert_eq!(c.check(), Ok(()));
        assert_eq!(c.routing, crate::routing::Routing::LeastLoad);
        let groups = c.groups();
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[1], [ShardAddr::Unix("/b0".into()), ShardAddr::Unix("/b1".into())]);
        let c = parse(&["--tokenizer-dir", "/m", "--shard-group", "/a0,/a1", "--shard-group", "/b0"]).unwrap();
        assert!(c.check().unwrap_err().contains("as many shards"));
        let c = parse(&["--tokenizer-dir", "/m", "--shard-group", "/a0", "--shard-uds-path", "/s"]).unwrap();
        assert!(c.check().unwrap_err().contains("not both"));
        let c = parse(&["--tokenizer-dir", "/m", "--shard-group", "127.0.0.1:7000"]).unwrap();
        assert!(c.check().unwrap_err().contains("--shard-auth-token-file"));
        let dir = std::env::temp_dir().join(format!("pagemill-token-{}", std::process::id()));
        std::fs::write(&dir, "  s3cret \n").unwrap();
        let token = dir.to_str().unwrap();
        let c = parse(&["--tokenizer-dir", "/m", "--shard-group", "127.0.0.1:7000", "--shard-auth-token-file", token])
            .unwrap();
        assert_eq!(c.check(), Ok(()));
        assert!(c.shard_auth().is_ok());
        std::fs::write(&dir, "\n").unwrap();
        assert!(c.shard_auth().unwrap_err().contains("no token"));
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(RouterConfig::default().routing, crate::routing::Routing::Prefix);
    }

    #[test]
    fn kv_events_config_is_vllms_json_checked_at_parse() {
        let json = r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv"}"#;
        let c = parse(&["--kv-events-config", json, "--kv-events-layout", "array"]).unwrap();
        let k = c.kv_events_config.unwrap();
        assert!(k.publishes() && k.topic == "kv" && k.buffer_steps == 10_000);
        assert_eq!(c.kv_events_layout, crate::kv_events::Layout::Array);
        let err = parse(&["--kv-events-config", r#"{"enable": true}"#]).unwrap_err().to_string();
        assert!(err.contains("unknown field `enable`"), "{err}");
        assert!(RouterConfig::default().kv_events_config.is_none());
    }

    #[test]
    fn lora_options_take_vllms_forms() {
        let c = RouterConfig::default();
        assert!(!c.enable_lora && c.lora_modules.is_empty());
        assert_eq!((c.max_loras, c.max_lora_rank), (4, 16));
        let json = r#"{"name": "b", "path": "/b"}"#;
        let c = parse(&[
            "--enable-lora",
            "--lora-modules",
            "a=/a",
            json,
            "--lora-modules",
            "c=/c",
            "--max-lora-rank",
            "64",
        ])
        .unwrap();
        let names: Vec<&str> = c.lora_modules.iter().map(|m| m.name.as_str()).collect();
        assert_eq!((names, c.max_lora_rank), (vec!["a", "b", "c"], 64));
        assert!(parse(&["--max-lora-rank", "65"]).unwrap_err().to_string().contains("--max-lora-rank"));
        assert!(parse(&["--max-loras", "0"]).unwrap_err().to_string().contains("--max-loras"));
        assert!(parse(&["--lora-modules", "noequals"]).unwrap_err().to_string().contains("name=path"));
        let c = parse(&["--shard-uds-path", "/s", "--tokenizer-dir", "/m", "--lora-modules", "a=/a"]).unwrap();
        assert!(c.check().unwrap_err().contains("needs --enable-lora"));
        let table = option_table();
        let row = table.iter().find(|o| o.dest == "lora_modules").unwrap();
        assert_eq!((row.kind, row.value_name.as_deref()), ("many", Some("NAME=PATH")));
        assert_eq!(table.iter().find(|o| o.dest == "shard_uds_paths").unwrap().kind, "append");
    }

    #[test]
    fn sizes_parse_like_the_python_cli() {
        assert_eq!(parse_bytes("2MB"), Ok(2_000_000));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes(" 1.5k "), Ok(1536));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert!(parse_bytes("MB").is_err() && parse_bytes("3 furlongs").is_err());
    }

    #[test]
    fn the_table_lists_every_field_once() {
        let table = option_table();
        let dests: Vec<&str> = table.iter().map(|o| o.dest.as_str()).collect();
        let fields = serde_json::to_value(RouterConfig::default()).unwrap();
        let fields: Vec<&String> = fields.as_object().unwrap().keys().collect();
        assert_eq!(dests, fields);
        let by = |d: &str| table.iter().find(|o| o.dest == d).unwrap().clone();
        assert_eq!((by("port").kind, by("port").default.as_deref()), ("value", Some("3000")));
        assert_eq!((by("prefix_caching").flag.as_str(), by("prefix_caching").kind), ("no-prefix-caching", "flag"));
        assert_eq!(by("shutdown_timeout_s").flag, "shutdown-timeout");
        assert_eq!((by("shard_uds_paths").kind, by("shard_uds_paths").launcher_sets), ("append", true));
        assert_eq!(by("api_key").env.as_deref(), Some(API_KEY_ENV));
        assert_eq!(by("max_batch_total_tokens").default, None);
        assert!(by("cache_aware_admission").choices.is_empty());
        assert_eq!(by("reasoning_parser").choices, ["think", "qwen3", "deepseek_r1"]);
        assert_eq!(by("tool_call_parser").choices, ["hermes", "llama3_json", "mistral", "pythonic"]);
        assert!(table.iter().all(|o| !o.help.is_empty()), "every option has help");
    }
}
