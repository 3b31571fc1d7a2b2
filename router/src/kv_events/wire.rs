//! vLLM's `KVEventBatch` as msgpack, byte for byte as vLLM's msgspec
//! encoder writes it: `[ts, [event, ...], data_parallel_rank]`, each event
//! tagged with its class name. vLLM encodes events as maps keyed by field
//! name with the tag under `"type"` (`map`, what vllm-router reads); earlier
//! vLLM wrote them as arrays led by the tag (`array`, what llm-d's indexer
//! reads). Block hashes are unsigned 64-bit integers.

use rmpv::Value;

use crate::kv::{KvEvent, Medium};

/// How events are laid out inside a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// `{"type": "BlockStored", "block_hashes": [...], ...}` (vLLM now; vllm-router).
    Map,
    /// `["BlockStored", [...], ...]` (vLLM's earlier array_like; llm-d's kv-cache indexer).
    Array,
}

/// vLLM's medium names: its device pool, its CPU offload tier, and disk.
pub fn medium_name(m: Medium) -> &'static str {
    match m {
        Medium::Device => "GPU",
        Medium::Host => "CPU",
        Medium::Disk => "DISK",
    }
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn hashes(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|&x| Value::from(x)).collect())
}

/// One event's fields in vLLM's declaration order, tag first.
fn fields(e: &KvEvent) -> Vec<(&'static str, Value)> {
    match e {
        KvEvent::Stored { hashes: h, parent, tokens, block_size, medium, lora } => vec![
            ("type", s("BlockStored")),
            ("block_hashes", hashes(h)),
            ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
            ("token_ids", Value::Array(tokens.iter().map(|&t| Value::from(t)).collect())),
            ("block_size", Value::from(*block_size)),
            ("lora_id", lora.as_ref().map_or(Value::Nil, |l| Value::from(l.id))),
            ("medium", s(medium_name(*medium))),
            ("lora_name", lora.as_ref().map_or(Value::Nil, |l| s(&l.name))),
        ],
        KvEvent::Removed { hashes: h, medium } => {
            vec![("type", s("BlockRemoved")), ("block_hashes", hashes(h)), ("medium", s(medium_name(*medium)))]
        }
        KvEvent::Cleared => vec![("type", s("AllBlocksCleared"))],
    }
}

fn event(e: &KvEvent, layout: Layout) -> Value {
    let f = fields(e);
    match layout {
        Layout::Map => Value::Map(f.into_iter().map(|(k, v)| (s(k), v)).collect()),
        Layout::Array => Value::Array(f.into_iter().map(|(_, v)| v).collect()),
    }
}

/// The msgpack payload of one batch.
pub fn encode_batch(ts: f64, events: &[KvEvent], rank: u32, layout: Layout) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(|e| event(e, layout)).collect()),
        Value::from(rank),
    ]);
    let mut out = Vec::with_capacity(64);
    rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec cannot fail");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvEvent {
        KvEvent::Stored {
            hashes: vec![u64::MAX, 7],
            parent: None,
            tokens: vec![1, 2, 3, 4],
            block_size: 2,
            medium: Medium::Device,
            lora: None,
        }
    }

    fn decode(bytes: &[u8]) -> Value {
        rmpv::decode::read_value(&mut &bytes[..]).unwrap()
    }

    #[test]
    fn map_layout_is_vllms_tagged_struct() {
        let v = decode(&encode_batch(1.5, &[stored(), KvEvent::Cleared], 0, Layout::Map));
        let b = v.as_array().unwrap();
        assert_eq!((b[0].as_f64(), b[2].as_u64()), (Some(1.5), Some(0)));
        let e = b[1].as_array().unwrap();
        let keys: Vec<&str> = e[0].as_map().unwrap().iter().map(|(k, _)| k.as_str().unwrap()).collect();
        assert_eq!(
            keys,
            ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
        );
        let get = |k: &str| e[0].as_map().unwrap().iter().find(|(n, _)| n.as_str() == Some(k)).unwrap().1.clone();
        assert_eq!(get("type").as_str(), Some("BlockStored"));
        assert_eq!(get("block_hashes").as_array().unwrap()[0].as_u64(), Some(u64::MAX));
        assert!(get("parent_block_hash").is_nil());
        assert_eq!(get("medium").as_str(), Some("GPU"));
        assert!(get("lora_id").is_nil() && get("lora_name").is_nil());
        assert_eq!(e[1].as_map().unwrap().len(), 1);
    }

    #[test]
    fn an_adapters_blocks_carry_its_id_and_name() {
        let lora = Some(crate::kv::LoraTag { id: 3, name: "sql".into() });
        let KvEvent::Stored { hashes, parent, tokens, block_size, medium, .. } = stored() else { unreachable!() };
        let e = KvEvent::Stored { hashes, parent, tokens, block_size, medium, lora };
        let v = decode(&encode_batch(1.0, &[e], 0, Layout::Array));
        let a = v.as_array().unwrap()[1].as_array().unwrap()[0].as_array().unwrap().clone();
        assert_eq!((a[5].as_u64(), a[7].as_str()), (Some(3), Some("sql")));
    }

    #[test]
    fn array_layout_leads_with_the_tag() {
        let removed = KvEvent::Removed { hashes: vec![3], medium: Medium::Disk };
        let v = decode(&encode_batch(2.0, &[stored(), removed], 0, Layout::Array));
        let e = v.as_array().unwrap()[1].as_array().unwrap().clone();
        let a = e[0].as_array().unwrap();
        assert_eq!(a.len(), 8);
        assert_eq!((a[0].as_str(), a[4].as_u64(), a[6].as_str()), (Some("BlockStored"), Some(2), Some("GPU")));
        assert_eq!(a[3].as_array().unwrap().len(), 4);
        let r = e[1].as_array().unwrap();
        assert_eq!((r[0].as_str(), r[2].as_str()), (Some("BlockRemoved"), Some("DISK")));
    }
}
