//! The replay buffer: the last `buffer_steps` batches as published, and the
//! answer to a replay request in vLLM's framing. A subscriber that missed
//! sequence numbers sends `[start_seq as 8 bytes big-endian]` to the ROUTER
//! socket (a DEALER sends an empty delimiter first, a REQ adds it itself); it
//! gets `[seq, payload]` for every buffered batch from `start_seq` on, then
//! `[-1 as 8 bytes, ""]`. Pure: frames in, frames out.

use std::collections::VecDeque;

use bytes::Bytes;

/// The sequence number that ends a replay.
pub const END_SEQ: i64 = -1;

#[derive(Debug)]
pub struct ReplayBuffer {
    capacity: usize,
    batches: VecDeque<(u64, Bytes)>,
}

impl ReplayBuffer {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, batches: VecDeque::with_capacity(capacity.min(1024)) }
    }

    pub fn push(&mut self, seq: u64, payload: Bytes) {
        if self.batches.len() == self.capacity {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    pub fn len(&self) -> usize {
        self.batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// The reply to a request (as the ROUTER socket receives it: identity,
    /// empty delimiter, start seq): one message per batch, then the end
    /// marker; None for a malformed request (ignored, as vLLM does).
    pub fn answer(&self, request: &[Bytes]) -> Option<Vec<Vec<Bytes>>> {
        let [identity, delimiter, start] = request else { return None };
        if !delimiter.is_empty() || start.len() != 8 {
            return None;
        }
        let start = u64::from_be_bytes(start[..].try_into().expect("8 bytes"));
        let frame = |seq: Bytes, payload: Bytes| vec![identity.clone(), Bytes::new(), seq, payload];
        let mut out: Vec<Vec<Bytes>> = self
            .batches
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .map(|(seq, p)| frame(Bytes::copy_from_slice(&seq.to_be_bytes()), p.clone()))
            .collect();
        out.push(frame(Bytes::copy_from_slice(&END_SEQ.to_be_bytes()), Bytes::new()));
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(start: u64) -> Vec<Bytes> {
        vec![Bytes::from_static(b"peer"), Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())]
    }

    #[test]
    fn replays_from_the_start_seq_and_ends_with_the_marker() {
        let mut r = ReplayBuffer::new(3);
        for seq in 0..5u64 {
            r.push(seq, Bytes::from(vec![seq as u8]));
        }
        assert_eq!(r.len(), 3);
        let out = r.answer(&req(3)).unwrap();
        let seqs: Vec<i64> = out.iter().map(|m| i64::from_be_bytes(m[2][..].try_into().unwrap())).collect();
        assert_eq!(seqs, vec![3, 4, END_SEQ]);
        assert_eq!(out[0], vec![Bytes::from_static(b"peer"), Bytes::new(), out[0][2].clone(), Bytes::from(vec![3u8])]);
        assert!(out[2][3].is_empty());
        // Older than the buffer: what it still has.
        assert_eq!(r.answer(&req(0)).unwrap().len(), 4);
    }

    #[test]
    fn malformed_requests_get_no_answer() {
        let r = ReplayBuffer::new(2);
        assert!(r.answer(&[Bytes::from_static(b"p"), Bytes::new()]).is_none());
        assert!(r.answer(&[Bytes::from_static(b"p"), Bytes::from_static(b"x"), Bytes::from(vec![0; 8])]).is_none());
        assert!(r.answer(&[Bytes::from_static(b"p"), Bytes::new(), Bytes::from(vec![0; 4])]).is_none());
    }
}
