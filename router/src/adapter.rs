//! A registered LoRA adapter as every layer below the API names it: the
//! request carries it, the scheduler counts it against `--max-loras`, the KV
//! cache keys blocks by it and the shard loads it from its path. The registry
//! (lora/) makes them; this is only the value.

use std::sync::Arc;

use crate::proto::pb;

/// One registration of an adapter directory. Cheap to share (`Arc`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Adapter {
    /// Unique for the server's life: a name loaded again gets a new id, so
    /// blocks cached under the old registration are never reused for it.
    pub id: u32,
    /// What clients pick it by (OpenAI's `model`, TGI's `adapter_id`).
    pub name: String,
    /// The PEFT directory the shard loads.
    pub path: String,
    /// Digest of the directory's files (names, sizes, modification times, the
    /// config's text): the second KV tier's key, which outlives the server,
    /// names the weights rather than the id.
    pub fingerprint: String,
}

pub type AdapterRef = Arc<Adapter>;

impl Adapter {
    pub fn to_proto(&self) -> pb::Adapter {
        pb::Adapter { id: self.id, name: self.name.clone(), path: self.path.clone() }
    }
}

/// The adapter id a request runs with, 0 for the base model (ids start at 1).
pub fn id_of(adapter: Option<&AdapterRef>) -> u32 {
    adapter.map_or(0, |a| a.id)
}
