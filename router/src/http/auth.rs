//! `--api-key`: generation routes require `Authorization: Bearer <key>` (or
//! `x-api-key: <key>`, as Anthropic's clients send it);
//! health, metrics, info and the docs stay open (probes and scrapers).

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use crate::error::RouterError;

pub async fn require_api_key(State(app): State<AppState>, req: Request, next: Next) -> Result<Response, RouterError> {
    let Some(key) = app.api_key.as_deref() else {
        return Ok(next.run(req).await);
    };
    let headers = req.headers();
    let bearer = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")));
    // Anthropic's clients send the key as `x-api-key`.
    let given = bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok())).map(str::trim);
    match given {
        Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => Ok(next.run(req).await),
        Some(_) => Err(RouterError::Unauthorized("invalid API key".into())),
        None => {
            Err(RouterError::Unauthorized("missing `Authorization: Bearer <api key>` (or `x-api-key`) header".into()))
        }
    }
}

/// No early exit on the first differing byte: the time taken does not tell
/// an attacker how much of a guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn compares_whole_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
