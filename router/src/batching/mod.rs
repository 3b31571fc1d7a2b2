//! The batching loop of each shard group: the only place a group's
//! scheduling awaits. It takes the requests routing hands it, plans each step
//! with the pure scheduler, sends it to the group's shards through the
//! shard client, applies the reply and delivers the events (run.rs); a group
//! whose shards fail hands its sequences back to routing and waits for them
//! to return (recover.rs); its figures go to `RouterState` (gauges.rs).

mod gauges;
mod recover;
mod run;

pub use run::BatchingLoop;
