//! Radix tree over block-aligned token prefixes: each node is one full KV
//! block, keyed by the block's tokens under its parent. It only indexes
//! blocks; reference counts live in the allocator, and the manager tells the
//! tree when a block becomes unused (evictable) or used again. Each node also
//! keeps its block's content hash (block_hash.rs), chained from its parent's,
//! which is how KV-cache events name it.
//!
//! KV computed with a LoRA adapter is not the base model's: each adapter
//! registration (its id) has a root of its own, made on first use and
//! dropped with its last block, so the same tokens under two adapters (or an
//! adapter and the base) never share a block.

use std::collections::{BTreeSet, HashMap};

use super::block_hash::{block_hash, root_hash, HASH_SEED};
use super::events::LoraTag;
use crate::adapter::Adapter;

/// The base model's root; adapters' roots are made as needed.
const ROOT: usize = 0;
/// A root's block: it stands for the empty prefix, no block.
const NO_BLOCK: u32 = u32::MAX;

#[derive(Debug)]
struct Node {
    block: u32,
    /// Content hash of the whole prefix ending with this block.
    hash: u64,
    parent: usize,
    key: Box<[u32]>,
    children: HashMap<Box<[u32]>, usize>,
    last_access: u64,
    /// Only the tree holds the block (no running sequence uses it).
    unused: bool,
    /// The adapter the KV was computed with (None: the base model).
    lora: Option<LoraTag>,
}

#[derive(Debug)]
pub struct RadixCache {
    block_size: usize,
    nodes: Vec<Option<Node>>,
    vacant: Vec<usize>,
    by_block: HashMap<u32, usize>,
    /// The root of each adapter id with blocks in the tree (0, the base, is ROOT).
    roots: HashMap<u32, usize>,
    /// Evictable nodes: unused leaves, oldest first.
    lru: BTreeSet<(u64, usize)>,
    /// Nodes only the tree holds. Sequences hold whole prefixes from the root,
    /// so every such node lies in an all-unused subtree: all of them can be
    /// evicted, leaves first.
    unused_count: usize,
    tick: u64,
}

/// A block the tree gave up (`evict_one`), with what names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evicted {
    pub block: u32,
    pub hash: u64,
    /// Hash of the block before it (None: it was a prompt's first block).
    pub parent: Option<u64>,
    pub tokens: Box<[u32]>,
    pub lora: Option<LoraTag>,
}

impl RadixCache {
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size: block_size as usize,
            nodes: vec![Some(Self::root_node(None))],
            vacant: Vec::new(),
            by_block: HashMap::new(),
            roots: HashMap::from([(0, ROOT)]),
            lru: BTreeSet::new(),
            unused_count: 0,
            tick: 0,
        }
    }

    fn root_node(lora: Option<LoraTag>) -> Node {
        Node {
            block: NO_BLOCK,
            hash: root_hash(HASH_SEED),
            parent: ROOT,
            key: Box::new([]),
            children: HashMap::new(),
            last_access: 0,
            unused: false,
            lora,
        }
    }

    fn is_root(&self, id: usize) -> bool {
        self.node(id).block == NO_BLOCK
    }

    /// The root of `adapter`'s blocks, if it has any.
    fn root_of(&self, adapter: Option<&Adapter>) -> Option<usize> {
        self.roots.get(&adapter.map_or(0, |a| a.id)).copied()
    }

    fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: usize) -> &mut Node {
        self.nodes[id].as_mut().expect("live node")
    }

    /// Blocks held in the tree.
    pub fn len(&self) -> usize {
        self.by_block.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_block.is_empty()
    }

    pub fn contains(&self, block: u32) -> bool {
        self.by_block.contains_key(&block)
    }

    /// Blocks of the longest cached prefix of `tokens`, at most `max_blocks`.
    /// With `touch`, the matched nodes become the most recently used.
    /// `adapter`: whose KV (None: the base model's).
    pub fn match_prefix(
        &mut self,
        adapter: Option<&Adapter>,
        tokens: &[u32],
        max_blocks: usize,
        touch: bool,
    ) -> Vec<u32> {
        self.tick += 1;
        let tick = self.tick;
        let mut blocks = Vec::new();
        let Some(mut at) = self.root_of(adapter) else { return blocks };
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let Some(&child) = self.node(at).children.get(chunk) else {
                break;
            };
            at = child;
            if touch {
                self.set_access(child, tick);
            }
            blocks.push(self.node(child).block);
        }
        blocks
    }

    fn set_access(&mut self, id: usize, tick: u64) {
        let n = self.node(id);
        if self.lru.remove(&(n.last_access, id)) {
            self.lru.insert((tick, id));
        }
        self.node_mut(id).last_access = tick;
    }

    /// Indexes the full blocks of `tokens` held in `blocks` (table order).
    /// Returns the blocks newly added; the caller gives the tree a reference
    /// to each. Stops at the first block whose prefix the tree already maps to
    /// another block (that copy stays private to its sequence).
    pub fn insert(&mut self, adapter: Option<&Adapter>, tokens: &[u32], blocks: &[u32]) -> Vec<u32> {
        self.tick += 1;
        let tick = self.tick;
        let mut at = match self.root_of(adapter) {
            Some(root) => root,
            None => {
                let root = self.new_node(Self::root_node(LoraTag::of(adapter)));
                self.roots.insert(adapter.map_or(0, |a| a.id), root);
                root
            }
        };
        let mut added = Vec::new();
        for (chunk, &block) in tokens.chunks_exact(self.block_size).zip(blocks) {
            if let Some(&child) = self.node(at).children.get(chunk) {
                if self.node(child).block != block {
                    break;
                }
                at = child;
                self.set_access(child, tick);
                continue;
            }
            if self.by_block.contains_key(&block) {
                // The block is indexed under another prefix: never index it twice.
                break;
            }
            let lora = self.node(at).lora.clone();
            let id = self.new_node(Node {
                block,
                hash: block_hash(self.node(at).hash, chunk, lora.as_ref().map(|l| &*l.name)),
                parent: at,
                key: chunk.into(),
                children: HashMap::new(),
                last_access: tick,
                unused: false,
                lora,
            });
            // The parent is no longer a leaf.
            let p = self.node(at);
            self.lru.remove(&(p.last_access, at));
            self.node_mut(at).children.insert(chunk.into(), id);
            self.by_block.insert(block, id);
            added.push(block);
            at = id;
        }
        self.drop_root_if_empty(adapter);
        added
    }

    /// An adapter's root with no block under it is removed.
    fn drop_root_if_empty(&mut self, adapter: Option<&Adapter>) {
        let Some(a) = adapter else { return };
        if let Some(root) = self.roots.get(&a.id).copied() {
            if self.node(root).children.is_empty() {
                self.roots.remove(&a.id);
                self.nodes[root] = None;
                self.vacant.push(root);
            }
        }
    }

    fn new_node(&mut self, n: Node) -> usize {
        match self.vacant.pop() {
            Some(id) => {
                self.nodes[id] = Some(n);
                id
            }
            None => {
                self.nodes.push(Some(n));
                self.nodes.len() - 1
            }
        }
    }

    /// The manager reports that only the tree holds `block` now (or not).
    pub fn set_unused(&mut self, block: u32, unused: bool) {
        let Some(&id) = self.by_block.get(&block) else {
            return;
        };
        let n = self.node_mut(id);
        let was = std::mem::replace(&mut n.unused, unused);
        match (was, unused) {
            (false, true) => self.unused_count += 1,
            (true, false) => self.unused_count -= 1,
            _ => {}
        }
        let n = self.node(id);
        let (leaf, key) = (n.children.is_empty(), (n.last_access, id));
        if unused && leaf {
            self.lru.insert(key);
        } else {
            self.lru.remove(&key);
        }
    }

    /// Content hash of the prefix ending with `block`, and of the one before
    /// it (None at a prompt's first block).
    pub fn hash_of(&self, block: u32) -> Option<(u64, Option<u64>)> {
        let n = self.node(*self.by_block.get(&block)?);
        Some((n.hash, (!self.is_root(n.parent)).then(|| self.node(n.parent).hash)))
    }

    /// Removes the least recently used unused leaf; returns it (its block's
    /// tree reference is the caller's to release).
    pub fn evict_one(&mut self) -> Option<Evicted> {
        let (_, id) = self.lru.pop_first()?;
        let n = self.nodes[id].take().expect("live node");
        self.vacant.push(id);
        self.by_block.remove(&n.block);
        self.unused_count -= 1;
        let parent = n.parent;
        self.node_mut(parent).children.remove(&n.key);
        let p = self.node(parent);
        let at_root = self.is_root(parent);
        let parent_hash = (!at_root).then_some(p.hash);
        let (childless, unused, last_access) = (p.children.is_empty(), p.unused, p.last_access);
        let root_id = p.lora.as_ref().map_or(0, |l| l.id);
        if !at_root && childless && unused {
            self.lru.insert((last_access, parent));
        }
        if at_root && parent != ROOT && childless {
            // An adapter's last block: its root goes too.
            let id = root_id;
            if self.roots.get(&id) == Some(&parent) {
                self.roots.remove(&id);
                self.nodes[parent] = None;
                self.vacant.push(parent);
            }
        }
        Some(Evicted { block: n.block, hash: n.hash, parent: parent_hash, tokens: n.key, lora: n.lora })
    }

    /// Every indexed block's content hash (for checks and tests).
    pub fn hashes(&self) -> std::collections::HashSet<u64> {
        self.by_block.values().map(|&id| self.node(id).hash).collect()
    }

    /// Token ids of the prefix that ends with `block` (for checks and tests).
    pub fn prefix_of(&self, block: u32) -> Option<Vec<u32>> {
        let mut id = *self.by_block.get(&block)?;
        let mut parts = Vec::new();
        while !self.is_root(id) {
            let n = self.node(id);
            parts.push(n.key.clone());
            id = n.parent;
        }
        Some(parts.into_iter().rev().flat_map(|k| k.into_vec()).collect())
    }

    /// Blocks that eviction can return to the pool.
    pub fn reclaimable(&self) -> usize {
        self.unused_count
    }
}
