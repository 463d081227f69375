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
use super::tunnel::Watch;
use crate::evidence::{Kind, Mode, Record};
use crate::limits::volume::{Direction, Exceeded};
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

/// Refuse an allow whose volume budget (its rule's or its org's) is
/// spent: a `volume_exceeded` record naming the rule, and the refusal its
/// client is told (HTTP 429 with `Retry-After`; SOCKS5 and transparent as
/// any denial).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn over_volume(
    ctx: &Ctx,
    view: &View,
    (kind, mode): (Kind, Mode),
    peer: SocketAddr,
    allowed: &Verdict,
    (host, port): (Option<&Host>, Option<u16>),
    exceeded: &Exceeded,
    synthetic: Option<std::net::IpAddr>,
) -> Refused {
    let verdict = Verdict {
        reason: Reason::VolumeExceeded,
        would_deny: None,
        ..allowed.clone()
    };
    let detail = exceeded.detail();
    let mut refused = record_denial_at(
        ctx,
        view,
        (kind, mode),
        peer,
        &verdict,
        (host, port),
        Some(&detail),
        synthetic,
    )
    .await;
    if refused.failure.reason() == Reason::VolumeExceeded {
        refused.failure = Unserved::OverVolume(exceeded.retry_after);
    }
    refused
}

/// A relay that spent a volume budget (`watch` says which): its
/// `volume_exceeded` decision record, linked to the allow `id` by `conn`,
/// naming the rule and the budget (report mode: the allow's
/// `would_deny`, the tunnel having gone on), counted in the metric.
pub(crate) async fn volume_spent(ctx: &Ctx, conn: &Conn, id: &str, watch: Option<&Watch>) {
    let Some((scope, direction)) = watch.and_then(Watch::crossed) else {
        return;
    };
    let Some(volume) = watch.and_then(|w| w.lease().volume(&scope)) else {
        return;
    };
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
    let detail = Some(format!("{}: tunnel closed", exceeded.detail()));
    if conn.view.is_report() {
        c.report(Reason::VolumeExceeded, detail);
    } else {
        c.verdict.reason = Reason::VolumeExceeded;
        c.verdict.would_deny = None;
        c.detail = detail;
    }
    Box::pin(ctx.write(&mut c.record())).await;
    debug!(record = %id, "tunnel over its volume budget");
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
