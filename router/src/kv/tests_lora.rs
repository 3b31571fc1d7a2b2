//! The KV cache keyed by adapter: the same tokens under the base model and
//! under two adapters never share a block, each reuses its own, KV events
//! name the adapter, and an adapter's last evicted block takes its root.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;

use super::{KvEvent, KvManager};
use crate::adapter::Adapter;

const BS: u32 = 4;

fn adapter(id: u32, name: &str) -> Adapter {
    Adapter { id, name: name.into(), path: format!("/a/{name}"), fingerprint: format!("f-{name}") }
}

#[test]
fn the_same_tokens_under_two_adapters_and_the_base_share_no_block() {
    let kv = KvManager::new(64, BS, true).with_events();
    let (a, b) = (adapter(1, "sql"), adapter(2, "chat"));
    let tokens: Vec<u32> = (0..13).collect();
    let mut tables = Vec::new();
    for who in [None, Some(&a), Some(&b)] {
        assert_eq!(kv.peek_prefix(who, &tokens), 0, "nothing cached for {who:?} yet");
        let mut t = kv.acquire_prefix(who, &tokens);
        assert!(t.ensure_capacity(13));
        kv.commit(who, &t, &tokens);
        assert_eq!(kv.peek_prefix(who, &tokens), 3, "{who:?} reuses its own blocks");
        tables.push(t);
    }
    let blocks: Vec<&[u32]> = tables.iter().map(|t| &t.ids()[..3]).collect();
    for i in 0..3 {
        for j in i + 1..3 {
            assert!(blocks[i].iter().all(|x| !blocks[j].contains(x)), "tables {i} and {j} share a block");
        }
    }
    // A new registration of a name is another adapter: nothing of the old one is offered.
    assert_eq!(kv.peek_prefix(Some(&adapter(3, "sql")), &tokens), 0);
    let stored: Vec<(Option<u32>, Option<String>, Vec<u64>)> = kv
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::Stored { lora, hashes, .. } => {
                Some((lora.as_ref().map(|l| l.id), lora.map(|l| l.name.to_string()), hashes))
            }
            _ => None,
        })
        .collect();
    assert_eq!(stored.len(), 3);
    assert_eq!((stored[0].0, stored[1].0, stored[2].0), (None, Some(1), Some(2)));
    assert_eq!(stored[1].1.as_deref(), Some("sql"));
    assert!(stored[0].2.iter().all(|h| !stored[1].2.contains(h) && !stored[2].2.contains(h)), "hashes differ");
    drop(tables);
    // Pressure evicts every cached block, adapters' roots with them.
    assert!(kv.allocate(kv.capacity()).is_some());
    assert_eq!(kv.stats().cached, 0);
    for who in [None, Some(&a), Some(&b)] {
        assert_eq!(kv.peek_prefix(who, &tokens), 0);
    }
}

proptest! {
    /// Random prompts from a small vocabulary under random adapters, taken
    /// from the cache, computed, committed and dropped in random order: every
    /// block a prompt takes from the cache was committed under the same
    /// adapter, with the same tokens before it.
    #[test]
    fn a_cached_block_only_ever_serves_its_own_adapter(
        ops in proptest::collection::vec((0u32..3, proptest::collection::vec(0u32..3, 1..14), any::<bool>()), 1..60),
    ) {
        let kv = KvManager::new(24, BS, true);
        let adapters: Vec<Option<Arc<Adapter>>> =
            vec![None, Some(Arc::new(adapter(1, "a"))), Some(Arc::new(adapter(2, "b")))];
        // Block -> (adapter id, the tokens of its whole prefix) when committed.
        let mut owner: HashMap<u32, (u32, Vec<u32>)> = HashMap::new();
        let mut held = Vec::new();
        for (who, tokens, keep) in ops {
            let a = adapters[who as usize].as_deref();
            let mut t = kv.acquire_prefix(a, &tokens);
            for (i, b) in t.ids().iter().enumerate() {
                let (id, prefix) = owner.get(b).expect("a cached block was committed");
                prop_assert_eq!(*id, who, "block {} of adapter {} served adapter {}", b, id, who);
                prop_assert_eq!(&prefix[..], &tokens[..(i + 1) * BS as usize]);
            }
            if !t.ensure_capacity(tokens.len() as u32) {
                continue;
            }
            kv.commit(a, &t, &tokens);
            for (i, &b) in t.ids().iter().enumerate().take(tokens.len() / BS as usize) {
                if kv.cached_prefix_of(b).is_some() {
                    owner.insert(b, (who, tokens[..(i + 1) * BS as usize].to_vec()));
                }
            }
            if keep {
                held.push(t);
            }
            // Blocks evicted and handed out again start a new life.
            owner.retain(|b, _| kv.cached_prefix_of(*b).is_some());
            if held.len() > 3 {
                held.remove(0);
            }
        }
    }
}
