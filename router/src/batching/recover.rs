//! A shard group that fails and comes back. A step that fails at the
//! transport (the shard process died, its socket or connection closed)
//! takes the group out of rotation: its sequences go to the other serving
//! groups through the routing layer and resume there by recompute, as a
//! preempted sequence does (prompt plus the tokens already streamed; the
//! stream only ever sees the tokens that follow). With no other group, they
//! end with the error, as a single group's always did. The loop then polls
//! its shards; once they answer, it warms them up again (a restarted shard
//! has a fresh, empty pool), starts a fresh KV manager and radix tree, and
//! the group is back in rotation.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tonic::Code;

use super::run::{BatchingLoop, StepFuture};
use crate::client::ShardedClient;
use crate::error::RouterError;
use crate::kv::{KvEvent, KvManager};
use crate::proto::pb;
use crate::queue::ResponseTx;
use crate::routing::Arrival;
use crate::scheduler::{Sequence, State};
use crate::shared_state::RouterState;

/// How often a group out of rotation asks its shards whether they are back.
const PROBE_EVERY: Duration = Duration::from_millis(500);
/// A step running this long gets a Health probe beside it (and again after
/// each answer): a shard answers Health from its event loop even during a
/// long forward, so only a shard that stopped answering (SIGSTOP, a wedged
/// host, a dropped network path) leaves it unanswered.
const WATCH_AFTER: Duration = Duration::from_secs(2);
/// No Health answer within this long while a step runs: the group is down.
const HUNG_AFTER: Duration = Duration::from_secs(10);

/// A failure of the group rather than of the request: the shard is gone or
/// unreachable. A shard that answers with an error status (INTERNAL,
/// INVALID_ARGUMENT...) is alive and keeps its place.
pub fn is_group_down(status: &tonic::Status) -> bool {
    matches!(status.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded)
}

/// A step running past WATCH_AFTER gets a Health probe of the group
/// alongside it, and no answer within HUNG_AFTER fails the step as
/// DEADLINE_EXCEEDED (the group goes out of rotation).
async fn watched(mut client: ShardedClient, req: pb::StepRequest) -> Result<pb::StepResponse, tonic::Status> {
    let mut probe = client.clone();
    let step = client.step(req);
    tokio::pin!(step);
    loop {
        tokio::select! {
            r = &mut step => return r,
            _ = tokio::time::sleep(WATCH_AFTER) => {}
        }
        tokio::select! {
            r = &mut step => return r,
            answer = tokio::time::timeout(HUNG_AFTER, probe.health()) => {
                if answer.is_err() {
                    return Err(tonic::Status::deadline_exceeded(format!(
                        "the shard group stopped answering: no Health reply within {} s during a step",
                        HUNG_AFTER.as_secs()
                    )));
                }
            }
        }
    }
}

impl BatchingLoop {
    /// The step to every shard of the group, watched (see `watched`); the
    /// future owns its clients, so the loop can hold two at once (ahead.rs).
    /// `req` gets the next step number, and `after` (a step number, 0: none) as the step the
    /// shard must run first.
    pub(super) fn send(&mut self, req: &mut pb::StepRequest, after: u64) -> StepFuture {
        self.step_id += 1;
        req.step_id = self.step_id;
        req.after_step_id = after;
        Box::pin(watched(self.client.clone(), req.clone()))
    }

    pub(super) fn step_failed(&mut self, status: tonic::Status) {
        if is_group_down(&status) {
            self.group_down(RouterError::from(status));
        } else {
            self.fail_all(RouterError::from(status));
        }
    }

    /// Out of rotation; every sequence of the group to another group.
    fn group_down(&mut self, err: RouterError) {
        tracing::error!("shard group {} failed, out of rotation: {err}", self.index);
        self.stats.serving.store(false, Ordering::SeqCst);
        let seqs = self.state.evacuate();
        let mut moving: Vec<(Sequence, ResponseTx)> = Vec::new();
        for s in seqs {
            if let Some(tx) = self.streams.remove(&s.id) {
                moving.push((s, tx));
            }
        }
        moving.extend(self.take_arrivals());
        self.hand_on(moving, &err);
        self.publish();
    }

    /// Arrivals that reached this group after it left rotation.
    fn take_arrivals(&mut self) -> Vec<(Sequence, ResponseTx)> {
        let mut out = Vec::new();
        while let Ok(a) = self.rx.try_recv() {
            let tokens = a.tokens();
            let _ = self
                .stats
                .pending_tokens
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| Some(p.saturating_sub(tokens)));
            match a {
                Arrival::New(e) => {
                    let tx = e.response_tx.clone();
                    out.push((Sequence::new(e), tx));
                }
                Arrival::Resume(s, tx) => out.push((s, tx)),
            }
        }
        out
    }

    /// To the other groups; what finds none ends with `err`.
    fn hand_on(&mut self, moving: Vec<(Sequence, ResponseTx)>, err: &RouterError) {
        if moving.is_empty() {
            return;
        }
        let n = moving.len();
        let left = self.placer.requeue(self.index, moving);
        RouterState::add(&self.router.requeued_total, (n - left.len()) as u64);
        if !left.is_empty() {
            tracing::error!("no other shard group serves: {} request(s) fail", left.len());
            self.router.healthy.store(false, Ordering::Relaxed);
        }
        RouterState::add(&self.router.requests_failed, left.len() as u64);
        for (_, tx) in left {
            let _ = tx.send(Err(err.clone()));
        }
    }

    /// Waits for the group's shards to answer again, then re-admits the
    /// group with a fresh pool. False when the router is shutting down.
    pub(super) async fn recover(&mut self) -> bool {
        loop {
            tokio::time::sleep(PROBE_EVERY).await;
            if self.rx.is_closed() && self.rx.is_empty() {
                return false;
            }
            let moving = self.take_arrivals();
            self.hand_on(moving, &RouterError::Unhealthy("the request's shard group is out of rotation".into()));
            if self.client.health().await.is_err() {
                continue;
            }
            match self.client.warmup(self.warmup).await {
                Ok(w) => {
                    let mut kv = KvManager::for_warmup(&w, self.state.kv.prefix_caching());
                    if self.state.kv.events_enabled() {
                        // Subscribers forget the old pool (its shards lost it with their memory).
                        self.send_events(vec![KvEvent::Cleared]);
                        kv = kv.with_events();
                    }
                    self.placer.set_kv(self.index, kv.clone());
                    self.state = State::new(self.state.config, kv);
                    self.publish();
                    self.stats.serving.store(true, Ordering::SeqCst);
                    self.router.healthy.store(true, Ordering::Relaxed);
                    tracing::info!("shard group {} is back in rotation ({} KV blocks)", self.index, w.num_blocks);
                    return true;
                }
                Err(e) => tracing::warn!("shard group {} answers but its warmup failed: {}", self.index, e.message()),
            }
        }
    }
}
