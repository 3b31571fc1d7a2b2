//! The identity every response and stream chunk of one request repeats
//! (id, creation time, model, fingerprint), shared by the OpenAI,
//! Responses and Messages routes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::AppState;
use crate::adapter::AdapterRef;

/// What every response and chunk of one request repeats.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl ResponseMeta {
    pub fn new(app: &AppState, prefix: &str) -> Self {
        let created = unix_now();
        // Unique per process and readable; not a secret.
        let id = format!("{prefix}-{created:x}{:06x}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
        Self {
            id,
            created,
            model: app.info.model_id.clone(),
            system_fingerprint: format!("pagemill-{}-{}", app.info.version, app.info.model_dtype),
        }
    }
}

impl ResponseMeta {
    /// The model a request ran on is reported as the adapter's name when it used one.
    pub fn serving(mut self, adapter: Option<&AdapterRef>) -> Self {
        if let Some(a) = adapter {
            self.model = a.name.clone();
        }
        self
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
