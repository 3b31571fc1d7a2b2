//! What the router records besides its counters: latency and size
//! histograms, and HTTP responses by route and status. Own code rather than
//! a global recorder, so every `RouterState` (and every unit test) has its
//! own numbers.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

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

    /// Prometheus text exposition of this histogram.
    pub(super) fn render(&self, name: &str, help: &str, out: &mut String) {
        self.render_labelled(name, help, "", out);
    }

    /// The same, every series with `labels` (`key="value",...`, or empty)
    /// before `le`: the gateway names carry the model's labels.
    pub(super) fn render_labelled(&self, name: &str, help: &str, labels: &str, out: &mut String) {
        let d = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cumulative += d.counts[i];
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", d.count);
        if labels.is_empty() {
            let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", d.sum, d.count);
        } else {
            let _ = writeln!(out, "{name}_sum{{{labels}}} {}\n{name}_count{{{labels}}} {}", d.sum, d.count);
        }
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
    pub(super) http: Mutex<BTreeMap<(String, u16), u64>>,
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
        let mut out = String::new();
        h.render_labelled("y", "help", "model_name=\"m\"", &mut out);
        assert!(out.contains("y_bucket{model_name=\"m\",le=\"2\"} 3\n"), "{out}");
        assert!(out.contains("y_count{model_name=\"m\"} 4\n"), "{out}");
    }
}
