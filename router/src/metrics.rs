//! A compact Prometheus registry: labelled HTTP counters and latency
//! histograms, plus the scheduler's gauges and counters from `RouterState`.
//! Own code rather than a global recorder so every `RouterState` (and every
//! unit test) has its own numbers and rendering stays one function.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use crate::state::RouterState;

const LATENCY_S: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
const TOKEN_LATENCY_S: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];
const TOKENS: &[f64] = &[1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0];

#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistogramData>,
}

#[derive(Debug, Default, Clone)]
struct HistogramData {
    /// Non-cumulative count per bucket; the last one is +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, inner: Mutex::new(HistogramData { counts: vec![0; bounds.len() + 1], ..Default::default() }) }
    }

    pub fn observe(&self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        let mut d = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        d.counts[i] += 1;
        d.sum += v;
        d.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).count
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let d = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cumulative += d.counts[i];
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", d.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", d.sum, d.count);
    }
}

#[derive(Debug)]
pub struct Metrics {
    /// Request arrival (before validation) to the first token.
    pub time_to_first_token: Histogram,
    /// Between consecutive tokens of one sequence as the client sees them.
    pub inter_token_latency: Histogram,
    /// Request arrival to the last token.
    pub request_duration: Histogram,
    /// Enqueued to admitted into a prefill.
    pub queue_time: Histogram,
    pub request_input_tokens: Histogram,
    pub request_generated_tokens: Histogram,
    /// Prompt tokens of accepted requests (once per request, whatever `n`).
    pub prompt_tokens_total: AtomicU64,
    /// (route, status) -> responses. Routes are axum's matched patterns, so
    /// the label set stays bounded whatever clients send.
    http: Mutex<BTreeMap<(String, u16), u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            time_to_first_token: Histogram::new(LATENCY_S),
            inter_token_latency: Histogram::new(TOKEN_LATENCY_S),
            request_duration: Histogram::new(LATENCY_S),
            queue_time: Histogram::new(LATENCY_S),
            request_input_tokens: Histogram::new(TOKENS),
            request_generated_tokens: Histogram::new(TOKENS),
            prompt_tokens_total: AtomicU64::new(0),
            http: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Metrics {
    pub fn count_http(&self, route: &str, status: u16) {
        let mut m = self.http.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((route.to_string(), status)).or_insert(0) += 1;
    }
}

pub(crate) fn scalar(out: &mut String, name: &str, kind: &str, help: &str, value: f64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
}

/// Prometheus text exposition of everything the router measures.
pub fn render(st: &RouterState) -> String {
    let get = |v: &AtomicU64| RouterState::get(v) as f64;
    let total = RouterState::get(&st.kv_blocks_total);
    let free = RouterState::get(&st.kv_blocks_free);
    let mut out = String::new();
    let gauges: [(&str, &str, f64); 7] = [
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
    ];
    for (name, help, v) in gauges {
        scalar(&mut out, name, "gauge", help, v);
    }
    let m = &st.metrics;
    let name = "pagemill_queue_size_by_priority";
    let _ = writeln!(out, "# HELP {name} Requests waiting for admission, by priority\n# TYPE {name} gauge");
    for (p, n) in st.queue_by_priority.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let _ = writeln!(out, "{name}{{priority=\"{p}\"}} {n}");
    }
    let counters: [(&str, &str, f64); 14] = [
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
    ];
    for (name, help, v) in counters {
        scalar(&mut out, name, "counter", help, v);
    }
    crate::metrics_tier::render(st, &mut out);
    scalar(
        &mut out,
        "pagemill_requeued_total",
        "counter",
        "Sequences moved to another shard group when theirs failed",
        get(&st.requeued_total),
    );
    render_groups(st, &mut out);
    let name = "pagemill_http_requests_total";
    let _ = writeln!(out, "# HELP {name} HTTP responses by route and status\n# TYPE {name} counter");
    for ((route, status), n) in m.http.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let route = route.replace('\\', "\\\\").replace('"', "\\\"");
        let _ = writeln!(out, "{name}{{route=\"{route}\",status=\"{status}\"}} {n}");
    }
    let histograms: [(&Histogram, &str, &str); 6] = [
        (&m.time_to_first_token, "pagemill_time_to_first_token_seconds", "Request arrival to first token"),
        (&m.inter_token_latency, "pagemill_inter_token_latency_seconds", "Time between consecutive tokens"),
        (&m.request_duration, "pagemill_request_duration_seconds", "Request arrival to last token"),
        (&m.queue_time, "pagemill_request_queue_seconds", "Time waiting in the queue"),
        (&m.request_input_tokens, "pagemill_request_input_tokens", "Prompt tokens per request"),
        (&m.request_generated_tokens, "pagemill_request_generated_tokens", "Generated tokens per sequence"),
    ];
    for (h, name, help) in histograms {
        h.render(name, help, &mut out);
    }
    out
}

/// Per data-parallel group figures, labelled `group="0"`, `group="1"`...
fn render_groups(st: &RouterState, out: &mut String) {
    type Field = fn(&crate::state::GroupStats) -> f64;
    let get = |v: &AtomicU64| RouterState::get(v) as f64;
    let rows: [(&str, &str, &str, Field); 10] = [
        ("pagemill_group_serving", "gauge", "1 while the shard group is in rotation", |g| g.serving() as u8 as f64),
        ("pagemill_group_queue_size", "gauge", "Requests waiting for admission in the group", |g| {
            RouterState::get(&g.queue_size) as f64
        }),
        ("pagemill_group_batch_size", "gauge", "Sequences in the group's running batch", |g| {
            RouterState::get(&g.batch_size) as f64
        }),
        ("pagemill_group_kv_blocks_total", "gauge", "KV blocks of the group's pool", |g| {
            RouterState::get(&g.kv_blocks_total) as f64
        }),
        ("pagemill_group_kv_blocks_free", "gauge", "KV blocks free (or evictable) in the group", |g| {
            RouterState::get(&g.kv_blocks_free) as f64
        }),
        ("pagemill_group_kv_blocks_cached", "gauge", "KV blocks indexed by the group's prefix cache", |g| {
            RouterState::get(&g.kv_blocks_cached) as f64
        }),
        ("pagemill_group_requests_placed_total", "counter", "Requests placed on the group", |g| {
            RouterState::get(&g.placed_total) as f64
        }),
        ("pagemill_group_prefill_tokens_total", "counter", "Prompt tokens the group computed", |g| {
            RouterState::get(&g.prefill_tokens_total) as f64
        }),
        (
            "pagemill_group_prefix_hit_tokens_total",
            "counter",
            "Prompt tokens the group served from its prefix cache",
            |g| RouterState::get(&g.prefix_hit_tokens_total) as f64,
        ),
        ("pagemill_group_generated_tokens_total", "counter", "Tokens the group generated", |g| {
            RouterState::get(&g.generated_tokens_total) as f64
        }),
    ];
    let _ = get;
    for (name, kind, help, f) in rows {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (i, g) in st.groups.iter().enumerate() {
            let _ = writeln!(out, "{name}{{group=\"{i}\"}} {}", f(g));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 1.7, 9.0, f64::NAN] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render("x", "help", &mut out);
        assert!(out.contains("x_bucket{le=\"1\"} 1\n"));
        assert!(out.contains("x_bucket{le=\"2\"} 3\n"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 4\n"));
        assert!(out.contains("x_count 4\n"));
        assert!(out.contains("x_sum 12.7\n"));
    }

    #[test]
    fn render_has_scheduler_names_and_routes() {
        let st = RouterState::default();
        RouterState::set(&st.kv_blocks_total, 10);
        RouterState::set(&st.kv_blocks_free, 4);
        st.metrics.count_http("/generate", 200);
        st.metrics.count_http("/generate", 200);
        st.metrics.count_http("/v1/chat/completions", 422);
        *st.queue_by_priority.lock().unwrap() = vec![(-1, 2), (0, 5)];
        let text = render(&st);
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
        let text = render(&st);
        assert!(text.contains("pagemill_group_prefill_tokens_total{group=\"1\"} 42\n"), "{text}");
        assert!(text.contains("pagemill_group_serving{group=\"0\"} 0\n"));
        assert!(text.contains("pagemill_group_serving{group=\"1\"} 1\n"));
    }
}
