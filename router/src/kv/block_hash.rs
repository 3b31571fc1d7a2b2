//! The content hash of a cached block as KV-cache events publish it:
//! vLLM's `sha256_cbor` chain with 64-bit parents, the scheme llm-d's
//! indexer computes its own block keys with.
//!
//! ```text
//! root     = low64(SHA-256(CBOR(seed)))              seed: a text string ("" here)
//! block(i) = low64(SHA-256(CBOR([parent, [token ids of block i], extra])))
//! ```
//!
//! `extra` is null for the base model and `[adapter name]` for a LoRA
//! adapter's blocks, as vLLM writes a request's extra keys.
//!
//! `parent` is block(i-1), or `root` for the first block; `low64` is the last
//! eight bytes of the digest read big-endian; CBOR is canonical (shortest
//! integer and length heads). So one hash names one whole token prefix, and
//! a consumer with the same block size and seed computes the same numbers
//! from a prompt's tokens.

use sha2::{Digest, Sha256};

/// The seed of the chain (vLLM's `PYTHONHASHSEED`, llm-d's `hashSeed`).
pub const HASH_SEED: &str = "";

/// CBOR head: major type `major` (0..7) with argument `n`, shortest form.
fn head(out: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    match n {
        0..=23 => out.push(m | n as u8),
        24..=0xff => out.extend_from_slice(&[m | 24, n as u8]),
        0x100..=0xffff => {
            out.push(m | 25);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(m | 26);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        _ => {
            out.push(m | 27);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
}

fn low64(bytes: &[u8]) -> u64 {
    let digest = Sha256::digest(bytes);
    u64::from_be_bytes(digest[24..32].try_into().expect("a SHA-256 digest has 32 bytes"))
}

/// The chain's root: the parent of every first block.
pub fn root_hash(seed: &str) -> u64 {
    let mut cbor = Vec::with_capacity(seed.len() + 9);
    head(&mut cbor, 3, seed.len() as u64);
    cbor.extend_from_slice(seed.as_bytes());
    low64(&cbor)
}

/// The hash of a block of `tokens` whose prefix hashes to `parent`, computed
/// by the base model (`lora: None`) or with the adapter of that name.
pub fn block_hash(parent: u64, tokens: &[u32], lora: Option<&str>) -> u64 {
    let mut cbor = Vec::with_capacity(16 + tokens.len() * 5);
    head(&mut cbor, 4, 3);
    head(&mut cbor, 0, parent);
    head(&mut cbor, 4, tokens.len() as u64);
    for &t in tokens {
        head(&mut cbor, 0, t as u64);
    }
    match lora {
        // null: no extra keys (no adapter, no multimodal input)
        None => cbor.push(0xf6),
        Some(name) => {
            head(&mut cbor, 4, 1);
            head(&mut cbor, 3, name.len() as u64);
            cbor.extend_from_slice(name.as_bytes());
        }
    }
    low64(&cbor)
}

/// Hashes of the full blocks of `tokens`, chained from `root_hash(HASH_SEED)`.
pub fn chain(tokens: &[u32], block_size: usize, lora: Option<&str>) -> Vec<u64> {
    let mut parent = root_hash(HASH_SEED);
    tokens
        .chunks_exact(block_size)
        .map(|chunk| {
            parent = block_hash(parent, chunk, lora);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cbor_heads_take_the_shortest_form() {
        let enc = |major, n| {
            let mut v = Vec::new();
            head(&mut v, major, n);
            v
        };
        assert_eq!(enc(0, 23), [0x17]);
        assert_eq!(enc(0, 24), [0x18, 24]);
        assert_eq!(enc(0, 500), [0x19, 0x01, 0xf4]);
        assert_eq!(enc(0, 70_000), [0x1a, 0, 1, 0x11, 0x70]);
        assert_eq!(enc(0, u64::MAX), [0x1b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(enc(4, 3), [0x83]);
        assert_eq!(enc(3, 0), [0x60]);
    }

    #[test]
    fn hashes_match_an_independent_cbor_encoding() {
        // CBOR of [root, [1, 300], null] written out by hand.
        let root = root_hash("");
        assert_eq!(root, low64(&[0x60]));
        let mut cbor = vec![0x83, 0x1b];
        cbor.extend_from_slice(&root.to_be_bytes());
        cbor.extend_from_slice(&[0x82, 0x01, 0x19, 0x01, 0x2c, 0xf6]);
        assert_eq!(block_hash(root, &[1, 300], None), low64(&cbor));
        // With an adapter: [root, [1], ["sql"]].
        let mut cbor = vec![0x83, 0x1b];
        cbor.extend_from_slice(&root.to_be_bytes());
        cbor.extend_from_slice(&[0x81, 0x01, 0x81, 0x63, b's', b'q', b'l']);
        assert_eq!(block_hash(root, &[1], Some("sql")), low64(&cbor));
    }

    #[test]
    fn adapters_name_the_same_tokens_apart() {
        let base = chain(&[1, 2, 3, 4], 2, None);
        let a = chain(&[1, 2, 3, 4], 2, Some("a"));
        let b = chain(&[1, 2, 3, 4], 2, Some("b"));
        for i in 0..2 {
            assert!(base[i] != a[i] && a[i] != b[i] && base[i] != b[i]);
        }
    }

    #[test]
    fn a_block_hash_names_its_whole_prefix() {
        let a = chain(&[1, 2, 3, 4, 5, 6], 2, None);
        let b = chain(&[9, 2, 3, 4, 5, 6], 2, None);
        assert_eq!(a.len(), 3);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert_eq!(chain(&[1, 2, 3, 4, 5], 2, None), a[..2].to_vec());
        assert_eq!(a[1], block_hash(a[0], &[3, 4], None));
        assert_ne!(root_hash("1"), root_hash(""));
    }
}
