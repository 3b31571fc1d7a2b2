//! TGI's timing headers on non-streaming responses, so clients and proxies
//! that read them (dashboards, the HF inference toolkit) keep working.

use axum::http::{HeaderMap, HeaderName, HeaderValue};

use crate::infer::InferResponse;

pub fn timing(resp: &InferResponse, compute_type: &str, generated_tokens: u32) -> HeaderMap {
    let now = std::time::Instant::now();
    let total = now - resp.start;
    let validation = resp.queued_at.saturating_duration_since(resp.start);
    let queue = resp.started_at.saturating_duration_since(resp.queued_at);
    let inference = now.saturating_duration_since(resp.started_at);
    let per_token = inference.as_millis() / generated_tokens.max(1) as u128;
    let values: [(&str, String); 9] = [
        ("x-compute-type", compute_type.to_string()),
        // TGI: seconds (float) here, milliseconds in the others.
        ("x-compute-time", format!("{}", total.as_secs_f64())),
        ("x-total-time", total.as_millis().to_string()),
        ("x-validation-time", validation.as_millis().to_string()),
        ("x-queue-time", queue.as_millis().to_string()),
        ("x-inference-time", inference.as_millis().to_string()),
        ("x-time-per-token", per_token.to_string()),
        ("x-prompt-tokens", resp.input_length.to_string()),
        ("x-generated-tokens", generated_tokens.to_string()),
    ];
    let mut headers = HeaderMap::new();
    for (name, value) in values {
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(name), v);
        }
    }
    headers
}
