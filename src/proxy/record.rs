//! Writing the records of connections, and the refusals that follow from
//! them: a connection's decision record as it stands ([`write_record`],
//! giving a [`Written`]); a refusal before any target was decided
//! ([`refused`], from the [`Link`]), a decided connection's denial
//! ([`denied`]) and an allow whose upstream could not be reached
//! ([`dial_failed`]), each giving a [`Refused`] to tell the client.

use tracing::debug;

use super::conn::{Conn, Link};
use super::ctx::Ctx;
use super::dial::DialError;
use super::failure::Unserved;
use super::http::Body;
use crate::evidence::Record;
use crate::limits::volume::{Direction, Exceeded};
use crate::limits::Watch;
use crate::policy::Reason;

/// A written decision record: its `id` (what its close record names) and
/// the reference its client may be shown.
#[derive(Debug, Clone)]
pub(crate) struct Written {
    pub id: String,
    pub shown: String,
}

/// Why nothing was opened: the failure, recorded under the reference
/// `record` (what the client is shown).
#[derive(Debug)]
pub(crate) struct Refused {
    /// `evidence_unavailable` if the record itself could not be written.
    pub failure: Unserved,
    pub record: String,
    /// What the client may be told beyond the reason.
    pub detail: Option<String>,
}

impl Refused {
    /// The HTTP answer.
    pub(crate) fn response(&self) -> http::Response<Body> {
        self.failure.response(&self.record, self.detail.as_deref())
    }
}

/// Write the record of `link`'s refusal ([`Link::refuse`]), decided
/// before any target was: what to tell the client.
pub(crate) async fn refused(ctx: &Ctx, link: &Link) -> Refused {
    let mut record = link.record();
    let written = ctx.write(&mut record).await;
    told(link.verdict.reason, written, &record, link.detail.clone())
}

/// Write the record of `conn`, denied or refused at its decision (by the
/// policy, or by [`super::admission::admit`]): what to tell the client.
pub(crate) async fn denied(ctx: &Ctx, conn: &mut Conn) -> Refused {
    let (written, record) = match write_record(ctx, conn).await {
        Ok(w) => (true, w.shown),
        Err(w) => (false, w.shown),
    };
    let failure = match conn.verdict.reason {
        Reason::VolumeExceeded => Unserved::OverVolume(conn.retry_after),
        reason => Unserved::Denied(reason),
    }
    .recorded(written);
    debug!(reason = %failure.reason(), side = ?failure.side(), %record, "denied");
    Refused {
        failure,
        record,
        detail: conn.detail.clone(),
    }
}

/// A denial for `reason`, recorded as `record` (or not `written`).
fn told(reason: Reason, written: bool, record: &Record, detail: Option<String>) -> Refused {
    let failure = Unserved::Denied(reason).recorded(written);
    debug!(reason = %failure.reason(), side = ?failure.side(), record = %record.id, "denied");
    Refused {
        failure,
        record: record.shown().to_string(),
        detail,
    }
}

/// A relay that spent a volume budget (`watch` says which): its
/// `volume_exceeded` decision record, linked to the allow `id` by `conn`,
/// naming the rule and the budget (report mode: the allow's
/// `would_deny`, the tunnel having gone on), counted in the metric.
pub(crate) async fn volume_spent(ctx: &Ctx, conn: &Conn, id: &str, watch: Option<&Watch>) {
    if let Some(mut record) = volume_record(ctx, conn, (id, "tunnel closed"), watch) {
        Box::pin(ctx.write(&mut record)).await;
        debug!(record = %id, "tunnel over its volume budget");
    }
}

/// The `volume_exceeded` record of a relay (`id`, cut as `what` says)
/// that spent a budget, if `watch` saw it spend one (counted in the
/// metric): see [`volume_spent`].
pub(crate) fn volume_record(
    ctx: &Ctx,
    conn: &Conn,
    (id, what): (&str, &str),
    watch: Option<&Watch>,
) -> Option<Record> {
    let (scope, direction) = watch.and_then(Watch::crossed)?;
    let volume = watch.and_then(|w| w.lease().volume(&scope))?;
    if let Some(org) = &conn.verdict.org {
        ctx.volumes.count(&org.name, direction);
    }
    let exceeded = Exceeded {
        limit: match direction {
            Direction::Up => volume.up,
            Direction::Down => volume.down,
        }
        .unwrap_or(0),
        scope,
        direction,
        window: volume.window,
        retry_after: Some(volume.window),
        lease: None,
    };
    let mut c = conn.clone();
    c.within = Some(id.to_string());
    let detail = Some(format!("{}: {what}", exceeded.detail()));
    if conn.view.is_report() {
        c.report(Reason::VolumeExceeded, detail);
    } else {
        c.verdict.reason = Reason::VolumeExceeded;
        c.verdict.would_deny = None;
        c.detail = detail;
    }
    Some(c.record())
}

/// An allowed decision whose upstream could not be reached: record it
/// (keeping `decision: allow`) with the error and the last address tried.
pub(crate) async fn dial_failed(ctx: &Ctx, conn: &mut Conn, error: DialError) -> Refused {
    conn.detail = Some(error.to_string());
    if let DialError::Timeout { addr } | DialError::Io { addr, .. } = &error {
        conn.ip = Some(addr.ip());
    }
    let (written, record) = match write_record(ctx, conn).await {
        Ok(w) => (true, w.shown),
        Err(w) => (false, w.shown),
    };
    Refused {
        failure: Unserved::Unreachable(error).recorded(written),
        record,
        detail: None,
    }
}

/// Write `conn`'s decision record as it stands and wait until it is with
/// the operating system: `Ok`, or `Err` if it could not be written (then
/// nothing may flow).
///
/// An allow keeps the room its record reserved for the close record in
/// `conn.owed` ([`crate::evidence::Owed`]).
pub(crate) async fn write_record(ctx: &Ctx, conn: &mut Conn) -> Result<Written, Written> {
    // Boxed: a record and its write are large, and a tunnel task would
    // otherwise keep room for them all its life.
    Box::pin(async {
        let mut record = conn.record();
        let written = ctx.write(&mut record).await;
        if let Some(owed) = record.owed.take() {
            conn.owed = Some(owed);
        }
        let w = Written {
            shown: record.shown().to_string(),
            id: record.id,
        };
        if written {
            Ok(w)
        } else {
            Err(w)
        }
    })
    .await
}
