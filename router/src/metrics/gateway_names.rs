//! The names routers and gateways read from an engine's `/metrics`: vLLM's
//! (llm-d and the Gateway API Inference Extension pick endpoints by
//! `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
//! `vllm:lora_requests_info`, `vllm:cache_config_info`) and SGLang's
//! (`sglang:num_queue_reqs`, `sglang:token_usage`, ...), each the same
//! quantity as the `pagemill_*` series it mirrors, with the labels those
//! engines put on it (`model_name`, and vLLM's `engine`). docs/metrics.md
//! pairs every name with its `pagemill_*` one.

use std::fmt::Write;
use std::sync::atomic::AtomicU64;

use super::histogram::Histogram;
use crate::shared_state::RouterState;

/// What the labels say about the served model and its KV pool.
#[derive(Debug, Clone, Default)]
pub struct EngineFacts {
    /// The served model's id (`/v1/models`).
    pub model_name: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks of one shard group's pool.
    pub num_gpu_blocks: u32,
    /// Storage dtype of the KV pool.
    pub cache_dtype: String,
    pub prefix_caching: bool,
    /// `--max-loras` (0: LoRA off).
    pub max_lora: u32,
}

/// (name, kind, help, value) of one series.
type Series = (&'static str, &'static str, &'static str, f64);

fn get(v: &AtomicU64) -> f64 {
    RouterState::get(v) as f64
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn labelled(out: &mut String, (name, kind, help, value): Series, labels: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}");
}

/// KV blocks held by sequences over the pool (free blocks include cached ones no sequence holds).
fn kv_usage(st: &RouterState) -> f64 {
    let total = RouterState::get(&st.kv_blocks_total);
    let free = RouterState::get(&st.kv_blocks_free);
    if total == 0 {
        0.0
    } else {
        total.saturating_sub(free) as f64 / total as f64
    }
}

fn vllm_series(st: &RouterState) -> [Series; 8] {
    let m = &st.metrics;
    let hits = get(&st.prefix_hit_tokens_total);
    [
        ("vllm:num_requests_running", "gauge", "Sequences in the running batch", get(&st.batch_size)),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission", get(&st.queue_size)),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage: 1 means every block is held", kv_usage(st)),
        ("vllm:prompt_tokens_total", "counter", "Prompt tokens of accepted requests", get(&m.prompt_tokens_total)),
        ("vllm:generation_tokens_total", "counter", "Tokens generated", get(&st.generated_tokens_total)),
        ("vllm:num_preemptions_total", "counter", "Sequences preempted", get(&st.preemptions_total)),
        (
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache (computed or hit)",
            get(&st.prefill_tokens_total) + hits,
        ),
        ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache", hits),
    ]
}

fn sglang_series(st: &RouterState) -> [Series; 5] {
    [
        ("sglang:num_running_reqs", "gauge", "Sequences in the running batch", get(&st.batch_size)),
        ("sglang:num_queue_reqs", "gauge", "Requests waiting for admission", get(&st.queue_size)),
        ("sglang:token_usage", "gauge", "KV-cache usage: 1 means every block is held", kv_usage(st)),
        (
            "sglang:prompt_tokens_total",
            "counter",
            "Prompt tokens of accepted requests",
            get(&st.metrics.prompt_tokens_total),
        ),
        ("sglang:generation_tokens_total", "counter", "Tokens generated", get(&st.generated_tokens_total)),
    ]
}

/// (histogram, vLLM name, SGLang name or "", help).
fn histograms(st: &RouterState) -> [(&Histogram, &'static str, &'static str, &'static str); 6] {
    let m = &st.metrics;
    [
        (
            &m.time_to_first_token,
            "vllm:time_to_first_token_seconds",
            "sglang:time_to_first_token_seconds",
            "Request arrival to first token",
        ),
        (
            &m.inter_token_latency,
            "vllm:inter_token_latency_seconds",
            "sglang:inter_token_latency_seconds",
            "Time between consecutive tokens",
        ),
        (
            &m.request_duration,
            "vllm:e2e_request_latency_seconds",
            "sglang:e2e_request_latency_seconds",
            "Request arrival to last token",
        ),
        (&m.queue_time, "vllm:request_queue_time_seconds", "sglang:queue_time_seconds", "Time waiting in the queue"),
        (&m.request_input_tokens, "vllm:request_prompt_tokens", "", "Prompt tokens per request"),
        (&m.request_generated_tokens, "vllm:request_generation_tokens", "", "Generated tokens per sequence"),
    ]
}

/// Every vLLM and SGLang series, after the `pagemill_*` ones.
pub fn render(st: &RouterState, facts: &EngineFacts, out: &mut String) {
    let model = escape(&facts.model_name);
    let vllm = format!("model_name=\"{model}\",engine=\"0\"");
    let sglang = format!("model_name=\"{model}\"");
    for series in vllm_series(st) {
        labelled(out, series, &vllm);
    }
    render_info(st, facts, out);
    for series in sglang_series(st) {
        labelled(out, series, &sglang);
    }
    let pages = format!("{sglang},page_size=\"{}\",num_pages=\"{}\"", facts.block_size, facts.num_gpu_blocks);
    labelled(out, ("sglang:cache_config_info", "gauge", "The KV pool's configuration (value 1)", 1.0), &pages);
    for (h, vllm_name, sglang_name, help) in histograms(st) {
        h.render_labelled(vllm_name, help, &vllm, out);
        if !sglang_name.is_empty() {
            h.render_labelled(sglang_name, help, &sglang, out);
        }
    }
}

/// vLLM's info gauges: the cache configuration (value 1), and the LoRA
/// adapters running and waiting, by name, comma-separated (value: the time
/// of this reading, so a reader takes the newest series).
fn render_info(st: &RouterState, facts: &EngineFacts, out: &mut String) {
    let python_bool = if facts.prefix_caching { "True" } else { "False" };
    let cache = format!(
        "block_size=\"{}\",cache_dtype=\"{}\",enable_prefix_caching=\"{python_bool}\",engine=\"0\",num_gpu_blocks=\"{}\"",
        facts.block_size,
        escape(&facts.cache_dtype),
        facts.num_gpu_blocks
    );
    labelled(
        out,
        ("vllm:cache_config_info", "gauge", "Information of the KV cache configuration (value 1)", 1.0),
        &cache,
    );
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let names = |m: &std::sync::Mutex<Vec<String>>| escape(&m.lock().unwrap_or_else(|e| e.into_inner()).join(","));
    let lora = format!(
        "max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"",
        facts.max_lora,
        names(&st.lora_running),
        names(&st.lora_waiting)
    );
    let help = "LoRA adapters running and waiting (value: when this was read)";
    labelled(out, ("vllm:lora_requests_info", "gauge", help, now), &lora);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> EngineFacts {
        EngineFacts {
            model_name: "tiny \"m\"".into(),
            block_size: 16,
            num_gpu_blocks: 100,
            cache_dtype: "bfloat16".into(),
            prefix_caching: true,
            max_lora: 0,
        }
    }

    #[test]
    fn the_gateway_names_carry_the_pagemill_values() {
        let st = RouterState::default();
        RouterState::set(&st.kv_blocks_total, 10);
        RouterState::set(&st.kv_blocks_free, 4);
        RouterState::set(&st.queue_size, 3);
        RouterState::set(&st.batch_size, 2);
        RouterState::set(&st.prefix_hit_tokens_total, 5);
        RouterState::set(&st.prefill_tokens_total, 7);
        let mut out = String::new();
        render(&st, &facts(), &mut out);
        let vllm = r#"{model_name="tiny \"m\"",engine="0"}"#;
        for line in [
            format!("vllm:num_requests_waiting{vllm} 3"),
            format!("vllm:num_requests_running{vllm} 2"),
            format!("vllm:kv_cache_usage_perc{vllm} 0.6"),
            format!("vllm:prefix_cache_queries_total{vllm} 12"),
            r#"sglang:num_queue_reqs{model_name="tiny \"m\""} 3"#.to_string(),
            r#"sglang:token_usage{model_name="tiny \"m\""} 0.6"#.to_string(),
        ] {
            assert!(out.contains(&format!("\n{line}\n")), "{line}\n{out}");
        }
        assert!(out.contains(r#"vllm:cache_config_info{block_size="16",cache_dtype="bfloat16",enable_prefix_caching="True",engine="0",num_gpu_blocks="100"} 1"#));
        assert!(out.contains(r#"sglang:cache_config_info{model_name="tiny \"m\"",page_size="16",num_pages="100"} 1"#));
        assert!(
            out.contains(r#"vllm:time_to_first_token_seconds_bucket{model_name="tiny \"m\"",engine="0",le="+Inf"} 0"#)
        );
        assert!(out.contains("# TYPE sglang:queue_time_seconds histogram"));
    }

    #[test]
    fn lora_info_is_timestamped_with_no_adapters() {
        let mut out = String::new();
        render(&RouterState::default(), &facts(), &mut out);
        let line = out.lines().find(|l| l.starts_with("vllm:lora_requests_info{")).unwrap();
        assert!(line.contains(r#"max_lora="0",running_lora_adapters="",waiting_lora_adapters="""#), "{line}");
        let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(value > 1.7e9, "{line}");
        assert!(!out.contains("kv_cache_usage_perc{model_name=\"tiny \\\"m\\\"\",engine=\"0\"} NaN"));
    }

    #[test]
    fn lora_info_names_the_adapters_running_and_waiting() {
        let st = RouterState::default();
        *st.lora_running.lock().unwrap() = vec!["sql".into(), "summary".into()];
        *st.lora_waiting.lock().unwrap() = vec!["chat".into()];
        let mut out = String::new();
        render(&st, &EngineFacts { max_lora: 4, ..facts() }, &mut out);
        let line = out.lines().find(|l| l.starts_with("vllm:lora_requests_info{")).unwrap();
        assert!(
            line.contains(r#"max_lora="4",running_lora_adapters="sql,summary",waiting_lora_adapters="chat""#),
            "{line}"
        );
    }
}
