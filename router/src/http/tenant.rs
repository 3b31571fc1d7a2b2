//! `x-tenant-id`: the tenant that `--max-running-per-tenant` caps, named by
//! a header so that a gateway in front of the server can key it by API key
//! or account without touching request bodies. It takes precedence over the
//! body's `user` (OpenAI, TGI `parameters.user`, Anthropic
//! `metadata.user_id`): the body is the client's word, the header the
//! gateway's.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;

use crate::error::RouterError;

pub const HEADER: &str = "x-tenant-id";
const MAX_LEN: usize = 256;

/// The tenant named by the request's header, if any.
pub struct Tenant(pub Option<String>);

impl Tenant {
    /// Puts the header's tenant into the body's `user` field, where one was sent.
    pub fn fill(self, user: &mut Option<String>) {
        if let Some(t) = self.0 {
            *user = Some(t);
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = RouterError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let Some(value) = parts.headers.get(HEADER) else {
            return Ok(Tenant(None));
        };
        parse(value.as_bytes()).map(|t| Tenant(Some(t)))
    }
}

fn parse(raw: &[u8]) -> Result<String, RouterError> {
    let bad = |why: &str| RouterError::Validation(format!("invalid `{HEADER}` header: {why}"));
    let text = std::str::from_utf8(raw).map_err(|_| bad("not UTF-8"))?.trim();
    if text.is_empty() {
        return Err(bad("empty"));
    }
    if text.len() > MAX_LEN {
        return Err(bad(&format!("longer than {MAX_LEN} bytes")));
    }
    if text.chars().any(char::is_control) {
        return Err(bad("control characters"));
    }
    Ok(text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        assert_eq!(parse(b" acme ").unwrap(), "acme");
        for raw in [&b""[..], b"  ", b"a\x01b", &[0xff, 0xfe], &[b'x'; 257]] {
            let err = parse(raw).unwrap_err();
            assert!(matches!(err, RouterError::Validation(ref m) if m.contains("x-tenant-id")), "{raw:?}: {err:?}");
        }
    }

    #[test]
    fn the_header_wins_over_the_body() {
        let mut user = Some("from-body".to_string());
        Tenant(Some("gw".into())).fill(&mut user);
        assert_eq!(user.as_deref(), Some("gw"));
        Tenant(None).fill(&mut user);
        assert_eq!(user.as_deref(), Some("gw"));
    }
}
