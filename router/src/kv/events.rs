//! What changed in the KV cache, as values: blocks a tier now holds, blocks
//! it dropped, a pool cleared. The KV code records them as it changes (only
//! when the manager was asked to, `KvManager::with_events`); the batching
//! loop drains them and hands them to the publisher (kv_events/). Nothing
//! here does I/O.

/// Where a block's KV lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// The shard's KV pool, which attention reads.
    Device,
    /// The second tier in host memory (`--kv-offload-memory`).
    Host,
    /// The second tier on disk (`--kv-offload-dir`).
    Disk,
}

impl Medium {
    /// The second tier's medium from the `kind` its shard reports.
    pub fn of_tier(kind: &str) -> Self {
        if kind == "disk" {
            Medium::Disk
        } else {
            Medium::Host
        }
    }
}

/// The LoRA adapter whose KV blocks hold, as events name it (vLLM's
/// `lora_id` and `lora_name`); None where blocks are the base model's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LoraTag {
    pub id: u32,
    pub name: std::sync::Arc<str>,
}

impl LoraTag {
    pub fn of(adapter: Option<&crate::adapter::Adapter>) -> Option<Self> {
        adapter.map(|a| Self { id: a.id, name: a.name.as_str().into() })
    }
}

/// One change of what a pool or tier holds. Hashes are `block_hash.rs`'s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks now held, a chain: `hashes[i]`'s parent is `hashes[i-1]`,
    /// the first's is `parent` (None: the first block of a prompt);
    /// `tokens` are theirs, `block_size` per block; computed with `lora`.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u32,
        medium: Medium,
        lora: Option<LoraTag>,
    },
    /// Blocks no longer held.
    Removed { hashes: Vec<u64>, medium: Medium },
    /// Everything the pool held is gone (its shards came back with a fresh one).
    Cleared,
}

/// The events recorded since the last drain; records nothing when off.
#[derive(Debug, Default)]
pub struct EventLog {
    on: bool,
    events: Vec<KvEvent>,
}

impl EventLog {
    pub fn enabled() -> Self {
        Self { on: true, events: Vec::new() }
    }

    pub fn is_on(&self) -> bool {
        self.on
    }

    pub fn push(&mut self, e: KvEvent) {
        if self.on {
            self.events.push(e);
        }
    }

    /// A removal joins the previous one of the same medium (evictions for one allocation).
    pub fn removed(&mut self, hash: u64, medium: Medium) {
        if !self.on {
            return;
        }
        match self.events.last_mut() {
            Some(KvEvent::Removed { hashes, medium: m }) if *m == medium => hashes.push(hash),
            _ => self.events.push(KvEvent::Removed { hashes: vec![hash], medium }),
        }
    }

    pub fn take(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }
}
