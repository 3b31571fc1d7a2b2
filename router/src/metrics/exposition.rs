//! `/metrics`: Prometheus text exposition of everything the router
//! measures, in one fixed order: scheduler gauges, queue by priority,
//! scheduler counters, the second KV tier, per-group figures, HTTP
//! responses, the latency histograms, then the same quantities under the
//! vLLM and SGLang names gateways read.

use std::fmt::Write;
use std::sync::atomic::AtomicU64;

use super::gateway_names::{self, EngineFacts};
use super::histogram::Histogram;
use super::kv_tier;
use crate::shared_state::{GroupStats, RouterState};

/// (name, help, value) of one unlabelled series.
type Series<'a> = (&'a str, &'a str, f64);

fn scalar(out: &mut String, name: &str, kind: &str, help: &str, value: f64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
}

fn get(v: &AtomicU64) -> f64 {
    RouterState::get(v) as f64
}

/// Prometheus text exposition of everything the router measures.
pub fn render(st: &RouterState, facts: &EngineFacts) -> String {
    let mut out = String::new();
    for (name, help, v) in gauges(st) {
        scalar(&mut out, name, "gauge", help, v);
    }
    render_queue_by_priority(st, &mut out);
    for (name, help, v) in counters(st) {
        scalar(&mut out, name, "counter", help, v);
    }
    for (name, help, v) in kv_tier::gauges(st) {
        scalar(&mut out, name, "gauge", help, v);
    }
    for (name, help, v) in kv_tier::counters(st) {
        scalar(&mut out, name, "counter", help, v);
    }
    scalar(
        &mut out,
        "pagemill_requeued_total",
        "counter",
        "Sequences moved to another shard group when theirs failed",
        get(&st.requeued_total),
    );
    render_groups(st, &mut out);
    render_lora(st, &mut out);
    render_http(st, &mut out);
    render_histograms(st, &mut out);
    gateway_names::render(st, facts, &mut out);
    out
}

fn gauges(st: &RouterState) -> [Series<'static>; 7] {
    let total = RouterState::get(&st.kv_blocks_total);
    let free = RouterState::get(&st.kv_blocks_free);
    [
        ("pagemill_kv_blocks_cached", "KV blocks indexed by the prefix cache", get(&st.kv_blocks_cached)),
        (
            "pagemill_kv_utilization",
            "Slots holding real tokens over slots allocated to running sequences",
            get(&st.kv_utilization_ppm) / 1e6,
        ),
        ("pagemill_queue_size", "Requests waiting for admission", get(&st.queue_size)),
        ("pagemill_batch_size", "Sequences in the running batch", get(&st.batch_size)),
        ("pagemill_kv_blocks_total", "KV blocks the router can hand out", total as f64),
        ("pagemill_kv_blocks_free", "KV blocks free", free as f64),
        ("pagemill_kv_blocks_used", "KV blocks held by sequences", total.saturating_sub(free) as f64),
    ]
}

fn render_queue_by_priority(st: &RouterState, out: &mut String) {
    let name = "pagemill_queue_size_by_priority";
    let _ = writeln!(out, "# HELP {name} Requests waiting for admission, by priority\n# TYPE {name} gauge");
    for (p, n) in st.queue_by_priority.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let _ = writeln!(out, "{name}{{priority=\"{p}\"}} {n}");
    }
}

fn counters(st: &RouterState) -> [Series<'static>; 14] {
    let m = &st.metrics;
    [
        (
            "pagemill_prefix_hit_tokens_total",
            "Prompt tokens served from the prefix cache",
            get(&st.prefix_hit_tokens_total),
        ),
        (
            "pagemill_preemptions_total",
            "Sequences preempted when the KV pool ran out or for a better-priority arrival",
            get(&st.preemptions_total),
        ),
        (
            "pagemill_kv_window_released_blocks_total",
            "KV blocks running sequences gave back behind a sliding window",
            get(&st.kv_window_released_blocks_total),
        ),
        (
            "pagemill_recomputed_tokens_total",
            "Tokens computed again after preemption dropped their KV",
            get(&st.recomputed_tokens_total),
        ),
        (
            "pagemill_requests_too_large_total",
            "Requests refused because they can never fit the KV pool or a batch",
            get(&st.requests_too_large_total),
        ),
        ("pagemill_requests_total", "Requests accepted", get(&st.requests_total)),
        ("pagemill_requests_failed_total", "Requests ended by a shard failure", get(&st.requests_failed)),
        ("pagemill_prompt_tokens_total", "Prompt tokens of accepted requests", get(&m.prompt_tokens_total)),
        ("pagemill_prefill_tokens_total", "Prompt tokens computed", get(&st.prefill_tokens_total)),
        ("pagemill_generated_tokens_total", "Tokens generated", get(&st.generated_tokens_total)),
        ("pagemill_decode_steps_total", "Decode steps run", get(&st.decode_steps_total)),
        (
            "pagemill_steps_ahead_total",
            "Decode steps sent before the reply of the step in flight (overlapping the router's work with the forward)",
            get(&st.steps_ahead_total),
        ),
        (
            "pagemill_decode_forward_seconds_total",
            "Shard-reported forward time of decode steps",
            get(&st.decode_forward_ns_total) / 1e9,
        ),
        (
            "pagemill_decode_step_seconds_total",
            "Router-measured time of decode steps",
            get(&st.decode_step_ns_total) / 1e9,
        ),
    ]
}

/// Requests accepted per LoRA adapter, labelled `adapter="name"`.
fn render_lora(st: &RouterState, out: &mut String) {
    let name = "pagemill_lora_requests_total";
    let _ = writeln!(out, "# HELP {name} Requests accepted per LoRA adapter\n# TYPE {name} counter");
    for (adapter, n) in st.lora_requests.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let adapter = adapter.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
        let _ = writeln!(out, "{name}{{adapter=\"{adapter}\"}} {n}");
    }
}

/// Per data-parallel group figures, labelled `group="0"`, `group="1"`...
fn render_groups(st: &RouterState, out: &mut String) {
    type Field = fn(&GroupStats) -> f64;
    let rows: [(&str, &str, &str, Field); 10] = [
        ("pagemill_group_serving", "gauge", "1 while the shard group is in rotation", |g| g.serving() as u8 as f64),
        ("pagemill_group_queue_size", "gauge", "Requests waiting for admission in the group", |g| get(&g.queue_size)),
        ("pagemill_group_batch_size", "gauge", "Sequences in the group's running batch", |g| get(&g.batch_size)),
        ("pagemill_group_kv_blocks_total", "gauge", "KV blocks of the group's pool", |g| get(&g.kv_blocks_total)),
        ("pagemill_group_kv_blocks_free", "gauge", "KV blocks free (or evictable) in the group", |g| {
            get(&g.kv_blocks_free)
        }),
        ("pagemill_group_kv_blocks_cached", "gauge", "KV blocks indexed by the group's prefix cache", |g| {
            get(&g.kv_blocks_cached)
        }),
        ("pagemill_group_requests_placed_total", "counter", "Requests placed on the group", |g| get(&g.placed_total)),
        ("pagemill_group_prefill_tokens_total", "counter", "Prompt tokens the group computed", |g| {
            get(&g.prefill_tokens_total)
        }),
        (
            "pagemill_group_prefix_hit_tokens_total",
            "counter",
            "Prompt tokens the group served from its prefix cache",
            |g| get(&g.prefix_hit_tokens_total),
        ),
        ("pagemill_group_generated_tokens_total", "counter", "Tokens the group generated", |g| {
            get(&g.generated_tokens_total)
        }),
    ];
    for (name, kind, help, f) in rows {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (i, g) in st.groups.iter().enumerate() {
            let _ = writeln!(out, "{name}{{group=\"{i}\"}} {}", f(g));
        }
    }
}

fn render_http(st: &RouterState, out: &mut String) {
    let name = "pagemill_http_requests_total";
    let _ = writeln!(out, "# HELP {name} HTTP responses by route and status\n# TYPE {name} counter");
    for ((route, status), n) in st.metrics.http.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let route = route.replace('\\', "\\\\").replace('"', "\\\"");
        let _ = writeln!(out, "{name}{{route=\"{route}\",status=\"{status}\"}} {n}");
    }
}

fn render_histograms(st: &RouterState, out: &mut String) {
    let m = &st.metrics;
    let histograms: [(&Histogram, &str, &str); 6] = [
        (&m.time_to_first_token, "pagemill_time_to_first_token_seconds", "Request arrival to first token"),
        (&m.inter_token_latency, "pagemill_inter_token_latency_seconds", "Time between consecutive tokens"),
        (&m.request_duration, "pagemill_request_duration_seconds", "Request arrival to last token"),
        (&m.queue_time, "pagemill_request_queue_seconds", "Time waiting in the queue"),
        (&m.request_input_tokens, "pagemill_request_input_tokens", "Prompt tokens per request"),
        (&m.request_generated_tokens, "pagemill_request_generated_tokens", "Generated tokens per sequence"),
    ];
    for (h, name, help) in histograms {
        h.render(name, help, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_has_scheduler_names_and_routes() {
        let st = RouterState::default();
        RouterState::set(&st.kv_blocks_total, 10);
        RouterState::set(&st.kv_blocks_free, 4);
        st.metrics.count_http("/generate", 200);
        st.metrics.count_http("/generate", 200);
        st.metrics.count_http("/v1/chat/completions", 422);
        *st.queue_by_priority.lock().unwrap() = vec![(-1, 2), (0, 5)];
        let text = render(&st, &EngineFacts::default());
        assert!(text.contains("pagemill_queue_size_by_priority{priority=\"-1\"} 2\n"));
        assert!(text.contains("pagemill_queue_size_by_priority{priority=\"0\"} 5\n"));
        assert!(text.contains("\npagemill_kv_blocks_used 6\n"));
        assert!(text.contains("pagemill_decode_steps_total 0\n"));
        assert!(text.contains("pagemill_http_requests_total{route=\"/generate\",status=\"200\"} 2\n"));
        assert!(text.contains("pagemill_http_requests_total{route=\"/v1/chat/completions\",status=\"422\"} 1\n"));
        assert!(text.contains("# TYPE pagemill_time_to_first_token_seconds histogram"));
    }

    #[test]
    fn groups_are_labelled() {
        let st = RouterState::with_groups(2);
        RouterState::set(&st.groups[1].prefill_tokens_total, 42);
        st.groups[0].serving.store(false, std::sync::atomic::Ordering::SeqCst);
        let text = render(&st, &EngineFacts::default());
        assert!(text.contains("pagemill_group_prefill_tokens_total{group=\"1\"} 42\n"), "{text}");
        assert!(text.contains("pagemill_group_serving{group=\"0\"} 0\n"));
        assert!(text.contains("pagemill_group_serving{group=\"1\"} 1\n"));
    }

    /// Every metric family `/metrics` writes is in docs/metrics.md.
    #[test]
    fn every_metric_is_documented() {
        let docs = include_str!("../../../docs/metrics.md");
        let st = RouterState::with_groups(1);
        let text = render(&st, &EngineFacts::default());
        let families: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next()).collect();
        assert!(families.len() > 60, "{families:?}");
        for name in families {
            assert!(docs.contains(&format!("`{name}`")), "{name} is not in docs/metrics.md");
        }
    }
}
