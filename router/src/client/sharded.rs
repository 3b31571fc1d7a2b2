//! Fan-out to every shard of a tensor-parallel group. Every shard gets every
//! call; rank 0's answer is the one the router uses.

use std::time::Duration;

use futures::future::join_all;

use super::{ShardAddr, ShardAuth, ShardClient};
use crate::proto::pb;

#[derive(Debug, Clone)]
pub struct ShardedClient {
    clients: Vec<ShardClient>,
}

macro_rules! fan_out {
    ($self:ident, $method:ident $(, $req:expr)?) => {{
        let futures = $self.clients.iter_mut().map(|c| {
            $(let req = $req.clone();)?
            async move { c.$method($(fan_out!(@arg req $req))?).await }
        });
        let mut results = join_all(futures).await.into_iter();
        // Any shard failing fails the call: the group is only as good as its weakest rank.
        let first = results.next().expect("at least one shard");
        let mut rest_err = None;
        for r in results {
            if let Err(e) = r {
                rest_err.get_or_insert(e);
            }
        }
        match (first, rest_err) {
            (Ok(_), Some(e)) => Err(e),
            (r, _) => r,
        }
    }};
    (@arg $name:ident $req:expr) => { $name };
}

impl ShardedClient {
    /// Connects to every shard, retrying until `timeout` (shards may still be
    /// loading). A shard that refuses the credential fails at once.
    pub async fn connect(addrs: &[ShardAddr], auth: &ShardAuth, timeout: Duration) -> Result<Self, String> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut clients = Vec::with_capacity(addrs.len());
        for addr in addrs {
            loop {
                match ShardClient::connect(addr, auth.clone()).await {
                    Ok(mut c) => match c.health().await {
                        Ok(_) => {
                            clients.push(c);
                            break;
                        }
                        Err(s) if s.code() == tonic::Code::Unauthenticated => {
                            return Err(format!("shard at {addr} refused the router: {}", s.message()))
                        }
                        Err(_) => {}
                    },
                    Err(e) if tokio::time::Instant::now() >= deadline => {
                        return Err(format!("cannot connect to shard at {addr}: {e}"))
                    }
                    Err(_) => {}
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(format!("shard at {addr} did not become healthy"));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(Self { clients })
    }

    /// A client with no shard behind it, for tests of what must not reach one.
    #[cfg(test)]
    pub fn disconnected() -> Self {
        Self { clients: Vec::new() }
    }

    pub fn num_shards(&self) -> usize {
        self.clients.len()
    }

    pub async fn info(&mut self) -> Result<pb::InfoResponse, tonic::Status> {
        fan_out!(self, info)
    }

    pub async fn health(&mut self) -> Result<pb::HealthResponse, tonic::Status> {
        fan_out!(self, health)
    }

    pub async fn warmup(&mut self, req: pb::WarmupRequest) -> Result<pb::WarmupResponse, tonic::Status> {
        let futures = self.clients.iter_mut().map(|c| {
            let req = req.clone();
            async move { c.warmup(req).await }
        });
        let results: Result<Vec<_>, _> = join_all(futures).await.into_iter().collect();
        let results = results?;
        // Each rank holds a slice of every block; the group can only use the smallest pool.
        let mut best = results[0].clone();
        best.num_blocks = results.iter().map(|r| r.num_blocks).min().unwrap_or(0);
        // Each rank stores its slice of a block: a key is usable only where every rank has it.
        if let Some(t) = best.kv_tier.as_mut() {
            for r in &results[1..] {
                let theirs = r.kv_tier.as_ref();
                let has: std::collections::HashSet<&String> =
                    theirs.map(|x| x.keys.iter().collect()).unwrap_or_default();
                t.keys.retain(|k| has.contains(k));
                t.capacity_blocks = t.capacity_blocks.min(theirs.map_or(0, |x| x.capacity_blocks));
            }
        }
        Ok(best)
    }

    pub async fn step(&mut self, req: pb::StepRequest) -> Result<pb::StepResponse, tonic::Status> {
        fan_out!(self, step, req)
    }
}
