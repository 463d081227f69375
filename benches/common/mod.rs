//! Pieces the whole-process benches share: a bounded closed-loop load,
//! stopping a child process, and medians.

#![allow(dead_code)]

use std::future::Future;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `clients` tasks each run `op` back to back for `secs`; returns completed
/// operations per second. Panics if any operation failed: a rate with
/// failures in it is not a measurement.
pub async fn closed_loop<F, Fut>(clients: usize, secs: f64, op: F) -> f64
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = bool> + Send,
{
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (ok, failed, op) = (ok.clone(), failed.clone(), op.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                if op().await {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let t0 = Instant::now();
    for t in tasks {
        let _ = t.await;
    }
    let f = failed.load(Ordering::Relaxed);
    assert!(f == 0, "{f} operations failed");
    ok.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64()
}

/// SIGTERM, then SIGKILL after 15 s.
pub fn stop(mut child: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(15);
    while matches!(child.try_wait(), Ok(None)) {
        if Instant::now() > deadline {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The median of the numbers that are not NaN (NaN if none).
pub fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
