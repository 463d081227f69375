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
    let failure = Unserved::Denied(conn.verdict.reason).recorded(written);
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
