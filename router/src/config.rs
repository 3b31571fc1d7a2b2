//! Router configuration, built once by the launcher and passed explicitly.

use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub hostname: String,
    pub port: u16,
    /// One unix socket per shard of the tensor-parallel group, rank order.
    pub shard_uds_paths: Vec<PathBuf>,
    /// Directory holding tokenizer.json (the model directory).
    pub tokenizer_dir: PathBuf,
    pub model_id: String,
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_batch_prefill_tokens: u32,
    /// Chunked prefill: at most this many prompt tokens per step, long
    /// prompts split across steps with decode steps in between; `None`: off.
    pub prefill_chunk_tokens: Option<u32>,
    /// Mixed steps: each step computes every running decode token plus
    /// prompt chunks up to this many tokens in all (vLLM's
    /// max_num_batched_tokens); `None`: a step is either a prefill or a decode.
    pub max_num_batched_tokens: Option<u32>,
    /// Upper bound on tokens (prompt + max_new_tokens) of all running
    /// sequences; `None` lets the KV pool size decide.
    pub max_batch_total_tokens: Option<u32>,
    pub max_batch_size: u32,
    pub max_concurrent_requests: u32,
    pub max_stop_sequences: u32,
    pub max_top_n_tokens: u32,
    pub default_max_new_tokens: u32,
    pub payload_limit: usize,
    pub validation_workers: usize,
    /// How long SIGTERM waits for in-flight requests before closing.
    pub shutdown_timeout_s: u64,
    /// Longest wait in the queue before a request is answered with
    /// `queue_timeout` (429); 0 waits forever.
    pub max_queue_wait_ms: u64,
    pub prefix_caching: bool,
    /// Admit the queued request with the longest cached prefix first.
    pub cache_aware_admission: bool,
    /// When set, generation routes require `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Largest `n` (OpenAI) / `best_of` (TGI) of one request.
    pub max_best_of: u32,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            hostname: "127.0.0.1".into(),
            port: 3000,
            shard_uds_paths: vec![],
            tokenizer_dir: PathBuf::new(),
            model_id: String::new(),
            max_input_tokens: 1024,
            max_total_tokens: 2048,
            max_batch_prefill_tokens: 4096,
            prefill_chunk_tokens: None,
            max_num_batched_tokens: None,
            max_batch_total_tokens: None,
            max_batch_size: 256,
            max_concurrent_requests: 128,
            max_stop_sequences: 16,
            max_top_n_tokens: 5,
            default_max_new_tokens: 100,
            payload_limit: 2_000_000,
            validation_workers: 2,
            shutdown_timeout_s: 30,
            max_queue_wait_ms: 120_000,
            prefix_caching: true,
            cache_aware_admission: false,
            api_key: None,
            max_best_of: 4,
        }
    }
}

impl RouterConfig {
    pub fn check(&self) -> Result<(), String> {
        if self.shard_uds_paths.is_empty() {
            return Err("at least one shard socket is required".into());
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
            return Err("max_num_batched_tokens must be positive (leave it unset for separate prefill and decode steps)".into());
        }
        if self.max_best_of == 0 {
            return Err("max_best_of must be positive".into());
        }
        if self.api_key.as_deref() == Some("") {
            return Err("api_key must not be empty (leave it unset to disable authentication)".into());
        }
        if self.max_batch_size == 0 || self.max_concurrent_requests == 0 {
            return Err("max_batch_size and max_concurrent_requests must be positive".into());
        }
        Ok(())
    }
}
