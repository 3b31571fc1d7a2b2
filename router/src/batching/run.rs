//! The batching loop of one shard group: the only place the scheduler
//! awaits. Each iteration takes new requests, drops those whose stream went
//! away, plans a step, sends it to the group's shards, applies the reply and
//! delivers the events. A group whose shards stop answering leaves rotation,
//! hands its sequences to the other groups (recover.rs) and comes back once
//! its shards answer again.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use tokio::sync::mpsc;

use crate::client::ShardedClient;
use crate::error::RouterError;
use crate::kv_events::EventSink;
use crate::proto::pb;
use crate::queue::ResponseTx;
use crate::routing::{Arrival, Placer};
use crate::scheduler::{is_terminal, plan_ahead, schedule, update, Event, SchedulerConfig, State, StepPlan};
use crate::shared_state::{GroupStats, RouterState};

pub(super) const IDLE_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

pub struct BatchingLoop {
    pub(super) client: ShardedClient,
    pub(super) state: State,
    pub(super) rx: mpsc::UnboundedReceiver<Arrival>,
    /// The stream of every queued or running request.
    pub(super) streams: HashMap<u64, ResponseTx>,
    pub(super) router: Arc<RouterState>,
    /// The routing layer (to hand sequences on when this group fails) and
    /// this group's index in it.
    pub(super) placer: Arc<Placer>,
    pub(super) index: usize,
    pub(super) stats: Arc<GroupStats>,
    /// What the group's shards are warmed up with, again when they come back.
    pub(super) warmup: pb::WarmupRequest,
    /// The last step's number (StepRequest.step_id).
    pub(super) step_id: u64,
    /// Where this group's KV-cache events go (`--kv-events-config`).
    pub(super) events: Option<EventSink>,
}

pub(super) type StepFuture = Pin<Box<dyn Future<Output = Result<pb::StepResponse, tonic::Status>> + Send>>;

/// A step sent to the group's shards and its plan, awaiting the reply.
struct InFlight {
    plan: StepPlan,
    step: StepFuture,
    /// When the shard could start it: sent, or the previous step's reply.
    sent: Instant,
}

/// Marks the loop dead when it ends, returns or panics (Drop runs while
/// unwinding), so `/health` can tell.
struct AliveGuard(Arc<RouterState>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.scheduler_alive.store(false, Ordering::SeqCst);
        if std::thread::panicking() {
            tracing::error!("the scheduler loop panicked");
        }
    }
}

impl BatchingLoop {
    /// The loop of group `index` of `placer`, whose KV manager it takes.
    pub fn new(
        client: ShardedClient,
        config: SchedulerConfig,
        rx: mpsc::UnboundedReceiver<Arrival>,
        placer: Arc<Placer>,
        index: usize,
        router: Arc<RouterState>,
        warmup: pb::WarmupRequest,
    ) -> Self {
        let (kv, stats) = placer.group(index);
        Self {
            client,
            state: State::new(config, kv),
            rx,
            streams: HashMap::new(),
            router,
            placer,
            index,
            stats,
            warmup,
            step_id: 0,
            events: None,
        }
    }

    /// Publishes the group's KV-cache events through `sink` (its KV manager records them).
    pub fn with_events(mut self, sink: EventSink) -> Self {
        self.events = Some(sink);
        self
    }

    pub async fn run(mut self) {
        self.router.scheduler_alive.store(true, Ordering::SeqCst);
        let _alive = AliveGuard(self.router.clone());
        // The step sent before the reply of the one in flight (ahead.rs).
        let mut ahead: Option<InFlight> = None;
        loop {
            let current = match ahead.take() {
                Some(next) => next,
                None => match self.plan_step().await {
                    Some(step) => step,
                    None => break,
                },
            };
            let InFlight { plan, mut step, sent } = current;
            let first = futures::poll!(step.as_mut());
            if first.is_pending() && self.state.config.schedule_ahead_from > 0 {
                // On the connection before the next step is (the shard runs them in arrival order).
                ahead = self.send_ahead(&plan).await;
            }
            let result = match first {
                Poll::Ready(r) => r,
                Poll::Pending => (&mut step).await,
            };
            let took = sent.elapsed();
            if let Some(next) = ahead.as_mut() {
                // Its time counts from this reply: before it, the shard was busy with this step.
                next.sent = Instant::now();
            }
            match result {
                Ok(resp) => {
                    let (events, stats) = update(&mut self.state, &plan, &resp);
                    if stats.unknown_ids > 0 {
                        tracing::warn!("the shard answered {} request id(s) it was not asked for", stats.unknown_ids);
                    }
                    RouterState::add(&self.router.generated_tokens_total, stats.generated_tokens);
                    RouterState::add(&self.stats.generated_tokens_total, stats.generated_tokens);
                    RouterState::add(&self.router.kv_window_released_blocks_total, stats.window_released_blocks);
                    self.count_tier(&resp, stats.tier_loaded_blocks, stats.tier_failed_loads);
                    if plan.has_decode() {
                        RouterState::add(&self.router.decode_steps_total, 1);
                        RouterState::add(&self.router.decode_forward_ns_total, resp.forward_ns);
                        RouterState::add(&self.router.decode_step_ns_total, took.as_nanos() as u64);
                    }
                    self.deliver(events);
                }
                Err(status) => {
                    // The step sent ahead is dropped (cancelled): the failure
                    // resets every sequence it names (fail_all or group_down).
                    ahead = None;
                    self.step_failed(status);
                }
            }
            self.publish();
        }
    }

    /// Waits for work and plans the next step from the state; sends it.
    /// None when the router shuts down.
    async fn plan_step(&mut self) -> Option<InFlight> {
        loop {
            if !self.stats.serving() {
                if !self.recover().await {
                    return None;
                }
                continue;
            }
            if self.state.is_idle() && self.state.finished.is_empty() && !self.state.kv.has_tier_ops() {
                match self.rx.recv().await {
                    Some(e) => self.enqueue(e),
                    None => return None,
                }
            }
            while let Ok(e) = self.rx.try_recv() {
                self.enqueue(e);
            }
            self.drop_leaving();
            let mut plan = schedule(&mut self.state, Instant::now());
            self.reject(std::mem::take(&mut plan.rejected));
            if plan.is_empty() {
                if plan.has_messages() && !self.step_finished_only(plan).await {
                    continue;
                }
                self.publish();
                if !self.state.is_idle() {
                    // Nothing fits right now: wait a moment for news (a new
                    // request, a client leaving, a deadline) rather than spin.
                    if let Ok(Some(e)) = tokio::time::timeout(IDLE_WAIT, self.rx.recv()).await {
                        self.enqueue(e);
                    }
                }
                continue;
            }
            RouterState::add(&self.router.preemptions_total, plan.preempted as u64);
            RouterState::add(&self.router.recomputed_tokens_total, plan.recomputed_tokens);
            RouterState::add(&self.router.prefill_tokens_total, plan.prompt_tokens);
            RouterState::add(&self.router.prefix_hit_tokens_total, plan.prefix_hit_tokens);
            RouterState::add(&self.router.kv_tier_hit_tokens_total, plan.tier_hit_tokens);
            RouterState::add(&self.stats.prefill_tokens_total, plan.prompt_tokens);
            RouterState::add(&self.stats.prefix_hit_tokens_total, plan.prefix_hit_tokens);
            let step = self.send(&mut plan.request, 0);
            // The blocks this plan admitted are told now, not after the step's
            // reply: a router placing the next request for the same prefix
            // sees them while a long prefill computes them.
            self.send_events(self.state.kv.take_events());
            return Some(InFlight { plan, step, sent: Instant::now() });
        }
    }

    /// The decode step after `inflight`, sent now when nothing but its reply
    /// could change it (ahead.rs); news that arrived first is taken in.
    async fn send_ahead(&mut self, inflight: &StepPlan) -> Option<InFlight> {
        while let Ok(e) = self.rx.try_recv() {
            self.enqueue(e);
        }
        self.drop_leaving();
        let mut plan = plan_ahead(&mut self.state, inflight)?;
        RouterState::add(&self.router.steps_ahead_total, 1);
        let mut step = self.send(&mut plan.request, inflight.request.step_id);
        // Polled once: its request joins the connection behind the one in flight.
        if let Poll::Ready(r) = futures::poll!(step.as_mut()) {
            step = Box::pin(std::future::ready(r));
        }
        Some(InFlight { plan, step, sent: Instant::now() })
    }

    pub(super) fn enqueue(&mut self, arrival: Arrival) {
        let tokens = arrival.tokens();
        let _ = self
            .stats
            .pending_tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| Some(p.saturating_sub(tokens)));
        match arrival {
            Arrival::New(entry) => {
                self.streams.insert(entry.id, entry.response_tx.clone());
                self.state.enqueue(entry);
            }
            Arrival::Resume(s, tx) => {
                self.streams.insert(s.id, tx);
                self.state.resume(s);
            }
        }
    }

    /// Only finished ids or tier saves to tell: a step without work. False on failure.
    async fn step_finished_only(&mut self, mut plan: StepPlan) -> bool {
        match self.send(&mut plan.request, 0).await {
            Ok(resp) => {
                self.state.kv.tier_forget(&resp.kv_lost);
                self.count_tier(&resp, 0, 0);
                true
            }
            Err(status) => {
                self.step_failed(status);
                false
            }
        }
    }

    /// Streams whose client went away (or whose stop sequence matched) end
    /// before the next step; queued requests past their deadline are told so.
    fn drop_leaving(&mut self) {
        let gone: Vec<u64> = self.streams.iter().filter(|(_, tx)| tx.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            self.streams.remove(&id);
            self.state.abort(id);
        }
        let now = Instant::now();
        let late = self.state.take_overdue(now);
        if !late.is_empty() {
            self.publish();
        }
        for s in late {
            if let Some(tx) = self.streams.remove(&s.id) {
                let waited = now.saturating_duration_since(s.queued_at).as_millis();
                let _ = tx.send(Err(RouterError::QueueTimeout(format!(
                    "waited {waited} ms in the queue without being scheduled"
                ))));
            }
        }
    }

    /// Requests that can never fit end with their error (a 4xx).
    fn reject(&mut self, rejected: Vec<(u64, RouterError)>) {
        if rejected.is_empty() {
            return;
        }
        RouterState::add(&self.router.requests_too_large_total, rejected.len() as u64);
        self.deliver(rejected.into_iter().map(|(id, e)| (id, Err(e))).collect());
        self.publish();
    }

    fn deliver(&mut self, events: Vec<Event>) {
        let mut failed = 0;
        for (id, event) in events {
            let terminal = is_terminal(&event);
            failed += matches!(event, Err(_)) as u64;
            let sent = self.streams.get(&id).is_some_and(|tx| tx.send(event).is_ok());
            if terminal {
                self.streams.remove(&id);
            } else if !sent {
                // The client is gone: the sequence ends before the next step.
                self.streams.remove(&id);
                self.state.abort(id);
            }
        }
        RouterState::add(&self.router.requests_failed, failed);
    }

    /// A shard call failed: every running request gets the error; queued
    /// ones wait for the next step.
    pub(super) fn fail_all(&mut self, err: RouterError) {
        tracing::error!("shard step failed: {err}");
        self.router.healthy.store(false, Ordering::Relaxed);
        let ids = self.state.fail_running();
        RouterState::add(&self.router.requests_failed, ids.len() as u64);
        for id in ids {
            if let Some(tx) = self.streams.remove(&id) {
                let _ = tx.send(Err(err.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::kv::KvManager;
    use crate::scheduler::admission::Budget;
    use crate::scheduler::AdmissionOrder;

    fn config() -> SchedulerConfig {
        SchedulerConfig {
            budget: Budget {
                max_batch_prefill_tokens: 8,
                max_batch_total_tokens: 64,
                max_batch_size: 2,
                watermark_blocks: 0,
                prefill_chunk_tokens: None,
            },
            speculate: 0,
            order: AdmissionOrder::Fifo,
            max_num_batched_tokens: None,
            priority_aging: None,
            max_running_per_tenant: None,
            max_loras: 4,
            sliding_window: 0,
            schedule_ahead_from: 1,
        }
    }

    /// What `/health` reads: false within a moment of the loop ending.
    async fn alive_turns_false(router: &RouterState) -> bool {
        for _ in 0..100 {
            if !router.scheduler_alive.load(Ordering::SeqCst) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    #[tokio::test]
    async fn a_loop_that_ends_is_seen_dead() {
        let router = Arc::new(RouterState::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let kv = KvManager::new(8, 4, true);
        let placer = Arc::new(Placer::single(tx.clone(), kv, &router));
        let sched = BatchingLoop::new(
            ShardedClient::disconnected(),
            config(),
            rx,
            placer.clone(),
            0,
            router.clone(),
            Default::default(),
        );
        let task = tokio::spawn(sched.run());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(router.scheduler_alive.load(Ordering::SeqCst));
        // The placer holds the loop's sender (and the loop the placer): the
        // router ends the loops by aborting them.
        drop(tx);
        drop(placer);
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        assert!(alive_turns_false(&router).await);
    }

    #[tokio::test]
    async fn a_loop_that_panics_is_seen_dead_within_a_second() {
        let router = Arc::new(RouterState::default());
        router.scheduler_alive.store(true, Ordering::SeqCst);
        let guard_state = router.clone();
        let task = tokio::spawn(async move {
            let _alive = AliveGuard(guard_state);
            panic!("test-only: the loop dies");
        });
        assert!(task.await.is_err());
        assert!(alive_turns_false(&router).await);
    }
}
