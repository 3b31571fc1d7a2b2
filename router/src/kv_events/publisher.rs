//! The publisher task: the batching loops hand it each step's KV events
//! (`EventSink::send`, which never blocks a loop); it merges the groups'
//! events (merge.rs), numbers each batch, sends `[topic, seq, payload]` on
//! the PUB socket, keeps the batch for replay (replay.rs) and answers replay
//! requests on the ROUTER socket. A socket error is logged, never fatal.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::config::KvEventsConfig;
use super::merge::Merger;
use super::replay::ReplayBuffer;
use super::wire::{encode_batch, Layout};
use crate::kv::KvEvent;

/// What a batching loop holds to publish its group's events.
#[derive(Debug, Clone)]
pub struct EventSink {
    tx: mpsc::Sender<(usize, Vec<KvEvent>)>,
    /// Set when a batch could not be queued: subscribers are told to start over.
    lost: Arc<AtomicBool>,
}

impl EventSink {
    /// Group `group`'s events of one step (nothing is sent for none).
    pub fn send(&self, group: usize, events: Vec<KvEvent>) {
        if !events.is_empty() && self.tx.try_send((group, events)).is_err() {
            if !self.lost.swap(true, Ordering::Relaxed) {
                tracing::warn!("KV events queue full: subscribers will be told to forget what they know");
            }
        }
    }
}

/// Numbering, merging, encoding and the replay buffer: everything but the sockets.
#[derive(Debug)]
pub struct Batcher {
    layout: Layout,
    merger: Merger,
    pub replay: ReplayBuffer,
    next_seq: u64,
}

impl Batcher {
    pub fn new(layout: Layout, buffer_steps: usize) -> Self {
        Self { layout, merger: Merger::default(), replay: ReplayBuffer::new(buffer_steps), next_seq: 0 }
    }

    /// The next batch (its seq and payload, also kept for replay), or None
    /// when the step changed nothing the server as a whole holds. After
    /// `lost` events the batch starts with `AllBlocksCleared`.
    pub fn batch(&mut self, group: usize, events: Vec<KvEvent>, lost: bool) -> Option<(u64, Bytes)> {
        let mut out = if lost { vec![self.merger.reset()] } else { Vec::new() };
        out.extend(self.merger.apply(group, events));
        if out.is_empty() {
            return None;
        }
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let payload = Bytes::from(encode_batch(ts, &out, 0, self.layout));
        let seq = self.next_seq;
        self.next_seq += 1;
        self.replay.push(seq, payload.clone());
        Some((seq, payload))
    }
}

/// vLLM binds an endpoint with a wildcard host or an ipc path and connects to any other.
fn binds(endpoint: &str) -> bool {
    endpoint.contains('*') || endpoint.contains("::") || endpoint.starts_with("ipc://")
}

/// `*` as a host means every interface.
fn bind_address(endpoint: &str) -> String {
    endpoint.replace("://*:", "://0.0.0.0:")
}

/// Opens the sockets (a bind that fails is a startup error) and starts the task.
pub async fn start(config: &KvEventsConfig, layout: Layout) -> Result<EventSink, String> {
    let mut publisher = PubSocket::new();
    if binds(&config.endpoint) {
        publisher
            .bind(&bind_address(&config.endpoint))
            .await
            .map_err(|e| format!("KV events: cannot bind {}: {e}", config.endpoint))?;
    }
    let replay = match &config.replay_endpoint {
        Some(r) => {
            let mut s = RouterSocket::new();
            s.bind(&bind_address(r)).await.map_err(|e| format!("KV events: cannot bind replay {r}: {e}"))?;
            Some(s)
        }
        None => None,
    };
    let (tx, rx) = mpsc::channel(config.max_queue_size);
    let lost = Arc::new(AtomicBool::new(false));
    let task = Task {
        publisher,
        connect_to: (!binds(&config.endpoint)).then(|| config.endpoint.clone()),
        replay,
        topic: Bytes::from(config.topic.clone().into_bytes()),
        batcher: Batcher::new(layout, config.buffer_steps),
        rx,
        lost: lost.clone(),
    };
    tracing::info!(
        "publishing KV events on {} (replay: {})",
        config.endpoint,
        config.replay_endpoint.as_deref().unwrap_or("none")
    );
    tokio::spawn(task.run());
    Ok(EventSink { tx, lost })
}

struct Task {
    publisher: PubSocket,
    /// An endpoint to connect to (instead of the bound one), not yet connected.
    connect_to: Option<String>,
    replay: Option<RouterSocket>,
    topic: Bytes,
    batcher: Batcher,
    rx: mpsc::Receiver<(usize, Vec<KvEvent>)>,
    lost: Arc<AtomicBool>,
}

impl Task {
    async fn run(mut self) {
        if let Some(endpoint) = self.connect_to.take() {
            if !self.connect(&endpoint).await {
                return;
            }
        }
        loop {
            tokio::select! {
                next = self.rx.recv() => match next {
                    Some((group, events)) => self.publish(group, events).await,
                    None => return,
                },
                req = recv_replay(&mut self.replay) => self.answer(req).await,
            }
        }
    }

    /// Connects the PUB socket (retrying until the subscriber listens) while
    /// batches keep being numbered and buffered for replay. False when the
    /// loops have ended meanwhile.
    async fn connect(&mut self, endpoint: &str) -> bool {
        let connect = self.publisher.connect(endpoint);
        tokio::pin!(connect);
        loop {
            tokio::select! {
                r = &mut connect => {
                    if let Err(e) = r {
                        tracing::warn!("KV events: cannot connect to {endpoint}: {e}");
                    }
                    return true;
                }
                next = self.rx.recv() => match next {
                    Some((group, events)) => {
                        self.batcher.batch(group, events, self.lost.swap(false, Ordering::Relaxed));
                    }
                    None => return false,
                },
                req = recv_replay(&mut self.replay) => {
                    if let (Some(s), Ok(m)) = (self.replay.as_mut(), req) {
                        send_replay(s, &self.batcher.replay, m).await;
                    }
                }
            }
        }
    }

    async fn publish(&mut self, group: usize, events: Vec<KvEvent>) {
        let lost = self.lost.swap(false, Ordering::Relaxed);
        let Some((seq, payload)) = self.batcher.batch(group, events, lost) else { return };
        let mut msg = ZmqMessage::from(self.topic.clone());
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(payload);
        if let Err(e) = self.publisher.send(msg).await {
            tracing::warn!("KV events: batch {seq} not sent: {e}");
        }
    }

    async fn answer(&mut self, req: Result<ZmqMessage, zeromq::ZmqError>) {
        match (self.replay.as_mut(), req) {
            (Some(s), Ok(m)) => send_replay(s, &self.batcher.replay, m).await,
            (_, Err(e)) => tracing::warn!("KV events: replay request failed: {e}"),
            (None, Ok(_)) => {}
        }
    }
}

/// The next replay request; never, without a replay socket.
async fn recv_replay(replay: &mut Option<RouterSocket>) -> Result<ZmqMessage, zeromq::ZmqError> {
    match replay.as_mut() {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}

async fn send_replay(socket: &mut RouterSocket, buffer: &ReplayBuffer, req: ZmqMessage) {
    let Some(reply) = buffer.answer(&req.into_vec()) else {
        tracing::warn!("KV events: malformed replay request ignored");
        return;
    };
    for frames in reply {
        let Ok(msg) = ZmqMessage::try_from(frames) else { continue };
        if let Err(e) = socket.send(msg).await {
            tracing::warn!("KV events: replay reply not sent: {e}");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::Medium;

    fn stored(h: u64) -> KvEvent {
        KvEvent::Stored {
            hashes: vec![h],
            parent: None,
            tokens: vec![1, 2],
            block_size: 2,
            medium: Medium::Device,
            lora: None,
        }
    }

    #[test]
    fn batches_are_numbered_from_zero_and_kept_for_replay() {
        let mut b = Batcher::new(Layout::Map, 2);
        assert_eq!(b.batch(0, vec![stored(1)], false).unwrap().0, 0);
        // A group caching what another holds changes nothing: no batch, no number.
        assert!(b.batch(1, vec![stored(1)], false).is_none());
        assert_eq!(b.batch(0, vec![stored(2)], false).unwrap().0, 1);
        let (seq, payload) = b.batch(0, vec![], true).unwrap();
        assert_eq!(seq, 2);
        let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        let events = v.as_array().unwrap()[1].as_array().unwrap().clone();
        assert_eq!(events.len(), 1, "only AllBlocksCleared after lost events");
        assert_eq!(b.replay.len(), 2);
    }

    #[test]
    fn endpoints_bind_or_connect_as_vllms_do() {
        assert!(binds("tcp://*:5557") && binds("tcp://[::]:5557") && binds("ipc:///tmp/kv"));
        assert!(!binds("tcp://indexer:5557"));
        assert_eq!(bind_address("tcp://*:5557"), "tcp://0.0.0.0:5557");
    }
}
