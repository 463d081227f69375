//! Writing the records of decided connections, and the refusals that
//! follow from them: a connection's decision record as it stands
//! ([`write_record`], giving a [`Written`]), a denial's ([`record_denial`])
//! and an allow whose upstream could not be reached ([`dial_failed`]), each
//! giving a [`Refused`] to tell the client; and a [`View`]'s records of
//! decisions made before any connection state exists.

use std::net::SocketAddr;

use tracing::debug;

use super::conn::Conn;
use super::ctx::{Ctx, View};
use super::dial::DialError;
use super::failure::Unserved;
use super::http::Body;
use crate::evidence::{Kind, Mode, Record};
use crate::policy::{Reason, Verdict};
use crate::proto::target::Host;

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

/// Write the record of a denial.
pub(crate) async fn record_denial(
    ctx: &Ctx,
    view: &View,
    (kind, mode): (Kind, Mode),
    peer: SocketAddr,
    verdict: &Verdict,
    (host, port): (Option<&Host>, Option<u16>),
    detail: Option<&str>,
) -> Refused {
    record_denial_at(
        ctx,
        view,
        (kind, mode),
        peer,
        verdict,
        (host, port),
        detail,
        None,
    )
    .await
}

/// [`record_denial`] of a connection to `synthetic`, an address of the
/// synthetic pool (`host` is then the name bound to it, if any).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn record_denial_at(
    ctx: &Ctx,
    view: &View,
    (kind, mode): (Kind, Mode),
    peer: SocketAddr,
    verdict: &Verdict,
    (host, port): (Option<&Host>, Option<u16>),
    detail: Option<&str>,
    synthetic: Option<std::net::IpAddr>,
) -> Refused {
    let mut record = view.record(kind, mode, peer, verdict, host, port);
    record.detail = detail.map(str::to_string);
    record.synthetic = synthetic;
    let written = ctx.write(&mut record).await;
    let failure = Unserved::Denied(verdict.reason).recorded(written);
    debug!(reason = %failure.reason(), side = ?failure.side(), record = %record.id, "denied");
    Refused {
        failure,
        record: record.shown().to_string(),
        detail: detail.map(str::to_string),
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

impl View {
    /// A decision record for this client and target.
    pub(crate) fn record(
        &self,
        kind: Kind,
        mode: Mode,
        client: SocketAddr,
        verdict: &Verdict,
        host: Option<&Host>,
        port: Option<u16>,
    ) -> Record {
        let mut r = Record::decided(kind, mode, client, verdict, &self.policy);
        r.host = host.map(|h| h.to_string());
        r.port = port;
        r
    }

    /// The record of a refusal decided before any target: `reason`, for
    /// this view's client, with `detail`.
    pub(crate) fn refusal(
        &self,
        (kind, mode): (Kind, Mode),
        client: SocketAddr,
        reason: Reason,
        detail: String,
    ) -> Record {
        let mut r = self.record(kind, mode, client, &self.verdict(reason), None, None);
        r.detail = Some(detail);
        r
    }
}
