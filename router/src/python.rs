//! The `pagemill._router` extension module: the launcher calls `serve`.

use std::path::PathBuf;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::config::RouterConfig;

#[pyfunction]
#[pyo3(signature = (
    shard_uds_paths, tokenizer_dir, model_id = String::new(), hostname = "127.0.0.1".to_string(), port = 3000,
    max_input_tokens = 1024, max_total_tokens = 2048, max_batch_prefill_tokens = 4096,
    prefill_chunk_tokens = None, max_num_batched_tokens = None,
    max_batch_total_tokens = None, max_batch_size = 256, max_concurrent_requests = 128,
    max_stop_sequences = 16, max_top_n_tokens = 5, default_max_new_tokens = 100,
    payload_limit = 2_000_000, shutdown_timeout_s = 30, log_level = "info".to_string(),
    prefix_caching = true, cache_aware_admission = false,
    api_key = None, max_best_of = 4, max_queue_wait_ms = 120_000
))]
#[allow(clippy::too_many_arguments)]
fn serve(
    py: Python<'_>,
    shard_uds_paths: Vec<PathBuf>,
    tokenizer_dir: PathBuf,
    model_id: String,
    hostname: String,
    port: u16,
    max_input_tokens: u32,
    max_total_tokens: u32,
    max_batch_prefill_tokens: u32,
    prefill_chunk_tokens: Option<u32>,
    max_num_batched_tokens: Option<u32>,
    max_batch_total_tokens: Option<u32>,
    max_batch_size: u32,
    max_concurrent_requests: u32,
    max_stop_sequences: u32,
    max_top_n_tokens: u32,
    default_max_new_tokens: u32,
    payload_limit: usize,
    shutdown_timeout_s: u64,
    log_level: String,
    prefix_caching: bool,
    cache_aware_admission: bool,
    api_key: Option<String>,
    max_best_of: u32,
    max_queue_wait_ms: u64,
) -> PyResult<()> {
    let config = RouterConfig {
        hostname,
        port,
        shard_uds_paths,
        tokenizer_dir,
        model_id,
        max_input_tokens,
        max_total_tokens,
        max_batch_prefill_tokens,
        prefill_chunk_tokens,
        max_num_batched_tokens,
        max_batch_total_tokens,
        max_batch_size,
        max_concurrent_requests,
        max_stop_sequences,
        max_top_n_tokens,
        default_max_new_tokens,
        payload_limit,
        shutdown_timeout_s,
        prefix_caching,
        cache_aware_admission,
        api_key,
        max_best_of,
        max_queue_wait_ms,
        ..RouterConfig::default()
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(format!("pagemill_router={log_level}")))
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
    py.detach(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime.block_on(crate::run(config))
    })
    .map_err(PyRuntimeError::new_err)
}

#[pymodule]
fn _router(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
