//! Bypass attempts: what the sandbox tried that the gateway ruleset
//! rejected instead of redirecting to Palisade (UDP and QUIC, other UDP,
//! direct connections to the gateway itself), read from the ruleset's
//! NFLOG group and put on record.
//!
//! With `[bypass] nflog_group = N`, start-up binds group N
//! ([`nflog::NflogSocket::bind`]; a group it cannot bind is a start-up
//! error) and [`serve`] reads it on a thread of its own until shutdown: each logged packet is
//! parsed ([`packet`], pure), given its org by source address under the
//! policy served now, counted in `palisade_bypass_attempts_total{org,
//! proto}` and into the summaries [`record`] writes as `kind = "bypass"`
//! records, about once a second, within each org's evidence budget.
//! Without the key nothing here runs.
//!
//! The ruleset does the rejecting (an ICMP port unreachable, a TCP reset),
//! rate-limited, so clients fall back at once; Palisade only records. A
//! packet the kernel could not queue to the socket (its buffer full) is
//! lost to the record, not let through.

pub(crate) mod nflog;
pub(crate) mod packet;
pub(crate) mod record;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::served::ServedHandle;
use nflog::NflogSocket;
use packet::Message;
use record::Bypasses;

/// How often the tallies are written.
pub(crate) use crate::limits::summary::SUMMARY_INTERVAL;
/// Longest a flush waits for room in the evidence writer's queue.
const FLUSH_WAIT: Duration = Duration::from_millis(200);
/// Errors other than overruns after which the reader gives up (a socket
/// that fails this often is broken, not busy).
const MAX_RECV_ERRORS: u32 = 100;

/// Read `socket` on a thread of its own until `shutdown`, counting every
/// logged packet, and write the tallies about once a second, and once
/// more on the way out.
pub(crate) async fn serve(
    socket: NflogSocket,
    bypasses: Bypasses,
    served: ServedHandle,
    shutdown: CancellationToken,
) {
    let bypasses = Arc::new(bypasses);
    let reader = {
        let (bypasses, shutdown) = (bypasses.clone(), shutdown.clone());
        std::thread::Builder::new()
            .name("bypass-nflog".into())
            .spawn(move || read(&socket, &bypasses, &served, &shutdown))
    };
    let reader = match reader {
        Ok(r) => Some(r),
        Err(e) => {
            warn!(error = %e, "cannot start the NFLOG reader: bypass attempts are not recorded");
            None
        }
    };
    let mut tick = tokio::time::interval(SUMMARY_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => bypasses.flush(FLUSH_WAIT).await,
        }
    }
    if let Some(r) = reader {
        // It sees the shutdown within one receive timeout.
        let _ = tokio::task::spawn_blocking(move || r.join()).await;
    }
    bypasses.flush(FLUSH_WAIT).await;
    if bypasses.pending_count() > 0 {
        warn!(
            packets = bypasses.pending_count(),
            "bypass attempts summarised but not written before shutdown"
        );
    }
}

/// The reader's loop: every datagram's packets counted, until `shutdown`.
fn read(
    socket: &NflogSocket,
    bypasses: &Bypasses,
    served: &ServedHandle,
    shutdown: &CancellationToken,
) {
    let mut buf = vec![0u8; nflog::MAX_DATAGRAM];
    let (mut overruns, mut errors) = (0u64, 0u32);
    while !shutdown.is_cancelled() {
        match socket.recv(&mut buf) {
            Ok(n) => {
                let policy = served.load().policy.clone();
                let (now, wall) = (Instant::now(), SystemTime::now());
                for m in packet::messages(&buf[..n]) {
                    match m {
                        Message::Packet(attempt) => bypasses.count(&attempt, &policy, now, wall),
                        Message::Unreadable(why) => debug!(why, "unreadable NFLOG packet"),
                        Message::Ack { .. } | Message::Other => {}
                    }
                }
            }
            Err(e) if crate::host::nothing_to_read(&e) => {}
            // ENOBUFS: the kernel dropped log messages.
            Err(e) if e.raw_os_error() == Some(105) => {
                overruns += 1;
                if overruns.is_power_of_two() {
                    warn!(
                        overruns,
                        "NFLOG receive buffer overrun: some bypass attempts were not recorded"
                    );
                }
            }
            Err(e) => {
                errors += 1;
                warn!(error = %e, "reading the NFLOG group failed");
                if errors >= MAX_RECV_ERRORS {
                    warn!("giving up on the NFLOG group: bypass attempts are no longer recorded");
                    return;
                }
            }
        }
    }
}
