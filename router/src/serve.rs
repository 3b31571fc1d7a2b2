//! Serving the routes until SIGINT/SIGTERM, then draining: on a signal the
//! listener stays open while accepted requests finish (new ones get a 503
//! `shutting_down`, not a refused connection, and `/health` turns 503 so
//! balancers move away); past `--shutdown-timeout-s` the requests still
//! running end with a `shutting_down` error, and the router exits.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::config::RouterConfig;
use crate::http::{self, AppState};
use crate::infer::Infer;
use crate::shared_state::RouterState;

/// After the shutdown timeout: time for the `shutting_down` error events to
/// reach their clients before the router exits regardless.
const CUTOFF_GRACE: Duration = Duration::from_secs(1);

/// Serves `app` until a signal and the drain after it; then ends the batching loops.
pub async fn serve(app: AppState, config: &RouterConfig, loops: Vec<JoinHandle<()>>) -> Result<(), String> {
    let (infer, state) = (app.infer.clone(), app.state.clone());
    let routes = http::router(app, config.payload_limit);
    let addr = format!("{}:{}", config.hostname, config.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    tracing::info!("router listening on http://{addr}");
    let timeout = Duration::from_secs(config.shutdown_timeout_s);
    let (deadline_tx, deadline_rx) = tokio::sync::oneshot::channel::<tokio::time::Instant>();
    // After the drain axum stops accepting and closes idle connections.
    let server = axum::serve(listener, routes).with_graceful_shutdown(async move {
        shutdown_signal().await;
        let _ = deadline_tx.send(tokio::time::Instant::now() + timeout);
        drain(&infer, &state, timeout).await;
    });
    let server = tokio::spawn(async move { server.await });
    // Past the deadline (plus a moment for the last responses to flush), the
    // router exits with whatever is still open.
    let hard_stop = async {
        match deadline_rx.await {
            Ok(deadline) => tokio::time::sleep_until(deadline + CUTOFF_GRACE * 2).await,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        r = server => r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?,
        _ = hard_stop => tracing::warn!("shutdown timeout reached with requests still in flight"),
    }
    for t in loops {
        t.abort();
    }
    Ok(())
}

/// Refuses new requests, waits up to `timeout` for the accepted ones, then
/// cuts off the rest with a `shutting_down` error.
async fn drain(infer: &Infer, state: &Arc<RouterState>, timeout: Duration) {
    state.draining.store(true, Ordering::SeqCst);
    tracing::info!("shutting down: draining {} in-flight request(s) (up to {}s)", infer.in_flight(), timeout.as_secs());
    if infer.drain(timeout).await {
        tracing::info!("drained: every accepted request was answered");
    } else {
        tracing::warn!("shutdown timeout reached: ending {} request(s) with a shutting_down error", infer.in_flight());
        infer.cut_off();
        infer.drain(CUTOFF_GRACE).await;
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {},
        _ = term.recv() => {},
    }
}
