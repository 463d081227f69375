//! Evidence: one JSON object per decision or close, written as JSON Lines and
//! handed to the operating system (a completed `write(2)`, or `fdatasync`
//! with `durability = "fsync"`) before the caller lets any allowed byte
//! flow. A failed write makes the writer unhealthy and the caller denies
//! `evidence_unavailable`: nothing is allowed unrecorded.
//!
//! Records are serialised once into their canonical form and hash-chained
//! ([`chain`]), signed at checkpoints with an Ed25519 key ([`key`]), and
//! written in batches by group commit on the callers' own threads
//! ([`writer`]), into rotating segment files ([`segment`]). [`verify`]
//! checks a directory end to end; [`query`] filters and exports.

mod canon;
pub(crate) mod chain;
#[doc(hidden)]
pub mod costs;
pub(crate) mod export;
pub(crate) mod field;
pub(crate) mod fleet;
pub(crate) mod key;
mod live;
pub(crate) mod merkle;
pub(crate) mod note;
pub(crate) mod proof;
pub(crate) mod query;
pub(crate) mod reference;
mod retention;
pub mod said;
pub(crate) mod segment;
pub mod select;
pub(crate) mod store;
pub(crate) mod tap;
mod ts;
pub(crate) mod verify;
pub(crate) mod witness;
mod writer;

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Deserializer, Serialize};

use crate::config::{Durability, EvidenceConfig};
use crate::policy::{Reason, Verdict};
use chain::Prepared;
use writer::{Entry, Ids, Io, Log};

pub use chain::CONTRACT_FIELDS;
pub use live::{Live, WitnessCounts};
pub(crate) use store::Owed;

/// `kind` of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Tcp,
    Http,
    Dns,
    /// A packet the gateway ruleset rejected instead of redirecting it to
    /// Palisade, read from its NFLOG group ([`crate::bypass`]).
    Bypass,
    /// A change of the enforcement check ([`crate::enforcement`]): the
    /// gateway ruleset not loaded as written (`failed`), or loaded again
    /// (`verified`).
    Enforcement,
    /// A grant of just-in-time access ([`crate::jit`]): given (`granted`)
    /// or ended (`expired`, `revoked`, `used_up`).
    Grant,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Tcp => "tcp",
            Kind::Http => "http",
            Kind::Dns => "dns",
            Kind::Bypass => "bypass",
            Kind::Enforcement => "enforcement",
            Kind::Grant => "grant",
        }
    }
}

/// `mode` of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Explicit,
    Transparent,
    Dns,
    /// The SOCKS5 listener.
    Socks5,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Explicit => "explicit",
            Mode::Transparent => "transparent",
            Mode::Dns => "dns",
            Mode::Socks5 => "socks5",
        }
    }
}

/// `event` of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    Decision,
    Close,
    /// Enforcement records: the gateway ruleset is not loaded as written.
    Failed,
    /// Enforcement records: the gateway ruleset is loaded as written.
    Verified,
    /// Grant records: a grant given.
    Granted,
    /// Grant records: a grant's TTL ended (or a reload denies its target).
    Expired,
    /// Grant records: an approver revoked a grant.
    Revoked,
    /// Grant records: a grant's `max_uses` are spent.
    UsedUp,
}

impl Event {
    pub fn as_str(self) -> &'static str {
        match self {
            Event::Decision => "decision",
            Event::Close => "close",
            Event::Failed => "failed",
            Event::Verified => "verified",
            Event::Granted => "granted",
            Event::Expired => "expired",
            Event::Revoked => "revoked",
            Event::UsedUp => "used_up",
        }
    }
}

/// What a grant record says of its grant. Its fields are in sorted order
/// (the chain's canonical form sorts nested keys too: a record whose
/// nested object is not sorted fails `evidence verify`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantFacts {
    /// The approval it answered, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<String>,
    /// The name of the approver's token (`[admin] approver_tokens`).
    pub approver: String,
    /// Who ended it (revoked: the approver; expired by a reload: `policy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_by: Option<String>,
    /// When its TTL ends (RFC 3339), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<String>,
    /// When it was given (RFC 3339).
    pub granted_at: String,
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_uses: Option<u32>,
    /// The one method it opens, under interception (none: any, tunnels too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The path pattern it opens, under interception (none: any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Why, as the approver gave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The name or CIDR it opens (`host` holds it too).
    pub target: String,
    /// Uses when the record was written.
    pub uses: u32,
}

/// One evidence record. The CONTRACT fields are always present (null where
/// unknown); the others appear only on the records they belong to.
///
/// Reading one back ([`query::read_records`]) ignores fields it does not
/// know, such as the chain's `seq`, `prev` and `hash` ([`query::Stored`]
/// keeps those).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    /// What a client is shown instead of `id` ([`mod@reference`]): an opaque
    /// keyed hash of it, set with `id` when the record is written.
    #[serde(rename = "ref", default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    pub ts: String,
    pub kind: Kind,
    pub event: Event,
    pub org: Option<Arc<str>>,
    pub client: Option<SocketAddr>,
    pub mode: Mode,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub sni: Option<String>,
    pub ip: Option<IpAddr>,
    /// A connection to an address of the synthetic pool (an org with
    /// `dns_answers = "synthetic"`): that address; `host` is the name bound
    /// to it and `ip` the real address dialled. Absent elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synthetic: Option<IpAddr>,
    /// `allow` or `deny`: never set by hand but derived from `reason`, at
    /// construction and again when the record is written, so that the two
    /// cannot disagree. Read it with [`Record::decision_str`].
    #[serde(deserialize_with = "decision_of")]
    decision: StaticStr,
    pub reason: Reason,
    pub rule: Option<Arc<str>>,
    pub policy: Arc<str>,
    /// SHA-256 of the baseline file (`[policy] baseline`) the decision was
    /// taken under; absent (that is null) without one, so a record of a
    /// gateway with no baseline reads back, and re-prints, as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<Arc<str>>,
    /// The layer of the deciding rule (`baseline` or `org`), where a
    /// rule decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<crate::policy::Layer>,
    /// Report mode: the reason enforcement would have denied this with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub would_deny: Option<crate::policy::Reason>,
    /// HTTP method and path of an absolute-form request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// What went wrong after an allow (upstream connect failure, ...), or the detail of a deny.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Close records: the decision record's id and the connection's totals.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conn: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_up: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_down: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// DNS records: the query type, the answers given (as text), and whether
    /// anything was sent upstream for this query.
    // A `Cow`: the type's mnemonic is static, no allocation per query.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qtype: Option<std::borrow::Cow<'static, str>>,
    // An `Arc`: shared with the kept answer it came from, no copy per query.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answers: Option<Arc<[String]>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<bool>,
    /// Intercepted connections: `true` on the connection's `tcp` records.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intercepted: Option<bool>,
    /// Intercepted requests: the response status (close records) and the
    /// id of the credential Palisade added (never its value).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
    /// Tunnels: what the tunnel was verified to carry (`tls`, `http`), or
    /// `opaque` when its rule lets it carry anything unverified.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tunnel: Option<crate::config::Carry>,
    /// Intercepted requests under service rules: the service, the
    /// repository, the refs or operation, the model (never a body or a
    /// credential).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<crate::policy::ServiceFacts>,
    /// Bypass records: the packets' protocol (`tcp`, `udp`, `icmp`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proto: Option<String>,
    /// Summary records: how many decisions this one record stands for
    /// (DNS refusals that found no room in the evidence queue, proxy
    /// denials over the per-client rate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// Proxy denial summaries: the count by reason code, and by host (the
    /// busiest few, the rest under `other`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasons: Option<std::collections::BTreeMap<String, u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hosts: Option<std::collections::BTreeMap<String, u64>>,
    /// Summary records: the first and last summarised decision's time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<[String; 2]>,
    /// Enforcement records: what differs between the ruleset file and
    /// what the kernel has loaded, one line each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub differs: Option<Vec<String>>,
    /// Grant records: the grant, its scope and end, its approver and the
    /// reason given ([`crate::jit`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<Box<GrantFacts>>,
    /// A miss put to the decider (`[decider]`): what it said, or the deny
    /// that stood for an error (`{"decision":"deny","error":"timeout after
    /// 500ms"}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decider: Option<said::Said>,
    /// Never written: the room reserved in the store for the close record
    /// an allow owes ([`store::Owed`]), set when the allow is written and
    /// carried to its close.
    #[serde(skip)]
    pub(crate) owed: Option<Arc<store::Owed>>,
}

impl Record {
    /// A decision record from a verdict; `id` and `ts` are set when written.
    pub fn decision(
        kind: Kind,
        mode: Mode,
        client: SocketAddr,
        verdict: &Verdict,
        policy: &Arc<str>,
    ) -> Record {
        // `policy` is the hash of the policy that decided.
        Record {
            id: String::new(),
            reference: None,
            ts: String::new(),
            kind,
            event: Event::Decision,
            org: verdict.org.as_ref().map(|o| o.name.clone()),
            client: Some(client),
            mode,
            host: None,
            port: None,
            sni: None,
            ip: None,
            decision: verdict.reason.decision(),
            reason: verdict.reason,
            rule: verdict.rule.clone(),
            would_deny: verdict.would_deny,
            policy: policy.clone(),
            baseline: None,
            layer: None,
            method: None,
            path: None,
            detail: None,
            conn: None,
            bytes_up: None,
            bytes_down: None,
            duration_ms: None,
            qtype: None,
            answers: None,
            upstream: None,
            intercepted: None,
            status: None,
            credential: None,
            tunnel: None,
            service: None,
            proto: None,
            count: None,
            reasons: None,
            hosts: None,
            window: None,
            synthetic: None,
            differs: None,
            grant: None,
            decider: None,
            owed: None,
        }
    }

    /// A decision record from a verdict of `policy`: its hash, its
    /// baseline's, and the layer of the deciding rule.
    pub fn decided(
        kind: Kind,
        mode: Mode,
        client: SocketAddr,
        verdict: &Verdict,
        policy: &crate::policy::Policy,
    ) -> Record {
        let mut r = Record::decision(kind, mode, client, verdict, policy.hash_arc());
        r.baseline = policy.baseline_hash().cloned();
        r.layer = policy.layer_of(verdict);
        r
    }

    /// A record to stand for `count` decisions like this one, made between
    /// `first` and `last`: what names one decision's target (client, host,
    /// port, SNI, address, rule, request, DNS question) is cleared, and
    /// `count` and `window` set. The caller adds what it tallied.
    pub fn summary(&self, count: u64, first: SystemTime, last: SystemTime) -> Record {
        let ts = |t: SystemTime| humantime::format_rfc3339_micros(t).to_string();
        Record {
            client: None,
            host: None,
            port: None,
            sni: None,
            ip: None,
            synthetic: None,
            rule: None,
            would_deny: None,
            method: None,
            path: None,
            tunnel: None,
            service: None,
            qtype: None,
            count: Some(count),
            window: Some([ts(first), ts(last)]),
            ..self.clone()
        }
    }

    /// `allow` or `deny`, as `reason` says.
    pub fn decision_str(&self) -> &'static str {
        self.reason.decision()
    }

    /// What a client may be shown of this record: its reference (never its
    /// `id`, which counts every org's decisions).
    pub fn shown(&self) -> &str {
        self.reference.as_deref().unwrap_or_default()
    }

    /// Whether `quoted` names this record: its reference (what a client is
    /// shown) or its id (what an operator may quote).
    pub fn is_named(&self, quoted: &str) -> bool {
        self.id == quoted || self.reference.as_deref() == Some(quoted)
    }

    /// Whether a close record will follow this one: an allowed
    /// connection's or forwarded request's decision (not a DNS answer).
    fn owes_close(&self) -> bool {
        self.event == Event::Decision && self.reason.is_allow() && self.kind != Kind::Dns
    }

    /// The close record of the connection this decision record opened.
    pub fn close(&self, bytes_up: u64, bytes_down: u64, duration_ms: u64) -> Record {
        Record {
            id: String::new(),
            ts: String::new(),
            event: Event::Close,
            conn: Some(self.id.clone()),
            bytes_up: Some(bytes_up),
            bytes_down: Some(bytes_down),
            duration_ms: Some(duration_ms),
            detail: None,
            ..self.clone()
        }
    }
}

/// `&'static str` under another name: serde's derive takes a field
/// written as a `&str` to borrow from the input, which would tie reading a
/// [`Record`] to `'static` input.
pub type StaticStr = &'static str;

/// `allow` or `deny`, the only decisions a record holds.
fn decision_of<'de, D: Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    let text = String::deserialize(d)?;
    ["allow", "deny"]
        .into_iter()
        .find(|x| *x == text)
        .ok_or_else(|| serde::de::Error::unknown_variant(&text, &["allow", "deny"]))
}

/// Evidence could not be written.
#[derive(Debug, thiserror::Error)]
pub enum EvidenceError {
    #[error("evidence unavailable: {0}")]
    Io(#[from] io::Error),
    #[error("evidence unavailable: the writer could not write the record")]
    Unavailable,
    #[error("evidence unavailable: the chain is sealed")]
    Sealed,
}

/// The evidence log shared by every listener. Cheap to call from any
/// task: a record is serialised on the caller's thread and written there
/// too, together with every other record pending at that moment, by
/// whichever caller finds the log free (group commit, see [`writer`]).
pub struct Evidence {
    log: Arc<Log>,
    /// The duties thread (checkpoints and rotation by time, retries).
    thread: Mutex<Option<JoinHandle<()>>>,
    dir: PathBuf,
    segment: PathBuf,
    durability: Durability,
    public_key: String,
    refs: reference::RefKey,
    /// Run once the chain is sealed (the witnesses' last submission).
    after_seal: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl std::fmt::Debug for Evidence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Evidence")
            .field("dir", &self.dir)
            .field("durability", &self.durability)
            .finish_non_exhaustive()
    }
}

impl Evidence {
    /// Open `dir` with default settings (key beside the dir, `os`
    /// durability, default checkpoints and rotation).
    pub fn open(dir: &Path) -> io::Result<Evidence> {
        Evidence::start(&EvidenceConfig::for_dir(dir))
    }

    /// Load (or create) the signing key, find the chain head in the dir,
    /// open a new segment and start the duties thread.
    pub fn start(cfg: &EvidenceConfig) -> io::Result<Evidence> {
        let key = key::load_or_create(&cfg.key)?;
        let refs = reference::RefKey::from_seed(&key.to_bytes());
        let public_key = key::public_hex(&key);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let ids = Ids::new(&cfg.replica, now);
        let live: Arc<Live> = Arc::default();
        live.started(&cfg.dir, &cfg.replica);
        let io = Io::open(cfg.clone(), key, &ids, live.clone())?;
        let segment = io.current_path();
        let log = Arc::new(Log::new(io, ids, live));
        let duties = log.clone();
        let thread = std::thread::Builder::new()
            .name("evidence-duties".into())
            .spawn(move || duties.duties())?;
        Ok(Evidence {
            log,
            thread: Mutex::new(Some(thread)),
            dir: cfg.dir.clone(),
            segment,
            durability: cfg.durability,
            public_key,
            refs,
            after_seal: Mutex::new(None),
        })
    }

    /// The evidence directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The segment opened at start.
    pub fn first_segment(&self) -> &Path {
        &self.segment
    }

    /// The checkpoint public key (hex).
    pub fn public_key(&self) -> &str {
        &self.public_key
    }

    /// What the writer has done so far (read by the metrics layer).
    pub fn live(&self) -> &Arc<Live> {
        &self.log.common.counters
    }

    /// Whether the last write succeeded (and the chain is not sealed).
    pub fn is_healthy(&self) -> bool {
        self.log.common.healthy.load(Ordering::Relaxed) && !self.log.closed.load(Ordering::Relaxed)
    }

    /// Assign `id`, `ref` and `ts`, and serialise the record, once, in its
    /// canonical form.
    fn stamp(&self, record: &mut Record) -> Result<Prepared, EvidenceError> {
        record.id = self.log.common.ids.next();
        record.reference = Some(self.refs.of(&record.id));
        record.ts = writer::now_ts();
        // Derived, never set: whatever changed `reason`, they agree.
        record.decision = record.reason.decision();
        Prepared::canonical(&*record).map_err(|e| EvidenceError::Io(io::Error::other(e)))
    }

    /// Assign `id` and `ts` and write the record. When this returns `Ok`
    /// the bytes are with the operating system (`os`) or on disk (`fsync`).
    /// Waits for room in the queue (back-pressure).
    ///
    /// An allowed connection's or request's decision record (one whose
    /// close record will follow) reserves room for that close in the store
    /// first, and carries the reservation in `record.owed` once written
    /// ([`store::Owed`]).
    pub async fn write(&self, record: &mut Record) -> Result<(), EvidenceError> {
        let (entry, owed) = self.acked(record)?;
        let permit = self
            .log
            .slots
            .acquire()
            .await
            .map_err(|_| EvidenceError::Sealed)?;
        permit.forget();
        let Ok(batch) = self.log.append(entry) else {
            self.log.slots.add_permits(1);
            return Err(EvidenceError::Sealed);
        };
        self.log.join_tick().await;
        if self.log.wait(&batch).await {
            record.owed = owed;
            Ok(())
        } else {
            Err(EvidenceError::Unavailable)
        }
    }

    /// [`Evidence::write`] at once, on this thread, for a caller that
    /// would rather not wait: `None`, with nothing stamped or written,
    /// when it cannot be done without waiting (no room in the queue,
    /// another caller leading a write, the writer paused); the caller then
    /// writes with [`Evidence::write`]. When it returns `Some(Ok(()))` the
    /// record is as durable as after `write`.
    pub fn write_now(&self, record: &mut Record) -> Option<Result<(), EvidenceError>> {
        // The record never waits in the queue (it is written within this
        // call, or not taken), so it holds no place in it; with the queue
        // full it is not taken either: the caller waits as others do.
        if self.log.slots.available_permits() == 0 {
            return None;
        }
        let mut owed = None;
        let written = self.log.write_now(|| {
            let (mut entry, o) = self.acked(record)?;
            entry.permit = false;
            owed = o;
            Ok(entry)
        })?;
        Some(match written {
            Ok(true) => {
                record.owed = owed;
                Ok(())
            }
            Ok(false) => Err(EvidenceError::Unavailable),
            Err(e) => Err(e),
        })
    }

    /// [`Evidence::write`] for several records at once: all in one batch
    /// (one `write(2)`, one wait), so all are written or none is. For a
    /// listener that decided several queries before answering any of them
    /// (DNS over UDP under load).
    pub async fn write_all(&self, records: &mut [Record]) -> Result<(), EvidenceError> {
        let n = u32::try_from(records.len()).map_err(|_| EvidenceError::Unavailable)?;
        if n == 0 {
            return Ok(());
        }
        let mut entries = Vec::with_capacity(records.len());
        let mut owed = Vec::with_capacity(records.len());
        for record in records.iter_mut() {
            let (entry, o) = self.acked(record)?;
            entries.push(entry);
            owed.push(o);
        }
        let permits = self
            .log
            .slots
            .acquire_many(n)
            .await
            .map_err(|_| EvidenceError::Sealed)?;
        permits.forget();
        let Ok(batch) = self.log.append_all(entries) else {
            self.log.slots.add_permits(records.len());
            return Err(EvidenceError::Sealed);
        };
        if !self.log.wait(&batch).await {
            return Err(EvidenceError::Unavailable);
        }
        for (record, o) in records.iter_mut().zip(owed) {
            record.owed = o;
        }
        Ok(())
    }

    /// A record stamped as an entry a `write` caller waits on, with the
    /// room reserved for its close record (given to the record once it is
    /// written).
    fn acked(&self, record: &mut Record) -> Result<(Entry, Option<Arc<Owed>>), EvidenceError> {
        let line = self.stamp(record)?;
        let owed = record.owes_close().then(|| {
            let bytes = store::close_bound(line.line_bound(), record.id.len());
            Arc::new(store::Owed::reserve(
                self.log.common.counters.store(),
                &record.org,
                bytes,
            ))
        });
        let entry = Entry {
            line,
            org: record.org.clone(),
            acked: true,
            permit: true,
            owed: None,
        };
        Ok((entry, owed))
    }

    /// Assign `id` and `ts` and append the record without waiting for it to
    /// be written (it rides the next batch written, within a few
    /// milliseconds). It is never dropped: over the queue's capacity it
    /// still goes in (accept loops wait for room with
    /// [`Evidence::wait_capacity`]), and after a write error it is kept until
    /// writing works again. For records that let nothing through (close
    /// records, refusals).
    pub fn submit(&self, record: &mut Record) {
        let line = match self.stamp(record) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "evidence record not serialisable");
                self.log.common.counters.write_failed();
                return;
            }
        };
        let permit = match self.log.slots.try_acquire() {
            Ok(p) => {
                p.forget();
                true
            }
            Err(_) => false,
        };
        let entry = Entry {
            line,
            org: record.org.clone(),
            acked: false,
            permit,
            owed: record.owed.take(),
        };
        if let Err(entry) = self.log.append(entry) {
            if entry.permit {
                self.log.slots.add_permits(1);
            }
            tracing::error!(id = %record.id, "evidence record submitted after the seal");
            self.log.common.counters.write_failed();
            return;
        }
        self.log.ride();
    }

    /// Assign `id` and `ts` and append the record, only into a free place
    /// in the queue, waiting at most `wait` for one; returns whether it was
    /// taken (once taken it is never dropped, as with [`Evidence::submit`]).
    /// For records that may be counted into a summary instead, so that a
    /// flood never grows the queue.
    pub async fn submit_within(&self, record: &mut Record, wait: std::time::Duration) -> bool {
        let permit = match self.log.slots.try_acquire() {
            Ok(p) => p,
            Err(tokio::sync::TryAcquireError::NoPermits) if !wait.is_zero() => {
                match tokio::time::timeout(wait, self.log.slots.acquire()).await {
                    Ok(Ok(p)) => p,
                    _ => return false,
                }
            }
            Err(_) => return false,
        };
        let line = match self.stamp(record) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "evidence record not serialisable");
                self.log.common.counters.write_failed();
                return false;
            }
        };
        permit.forget();
        let entry = Entry {
            line,
            org: record.org.clone(),
            acked: false,
            permit: true,
            owed: record.owed.take(),
        };
        if self.log.append(entry).is_err() {
            self.log.slots.add_permits(1);
            return false;
        }
        self.log.ride();
        true
    }

    /// Stop (or resume) taking records off the queue, as a writer stuck
    /// in a slow `write(2)` would (tests).
    #[cfg(test)]
    pub(crate) fn pause_writer(&self, paused: bool) {
        self.log.pause(paused);
    }

    /// Fail the next batch's write, as a full disk would (tests).
    #[cfg(test)]
    pub(crate) fn fail_next_write(&self) {
        self.log.fail_next_write();
    }

    /// Batches written so far (tests).
    #[cfg(test)]
    pub(crate) fn batches(&self) -> u64 {
        self.log.batches()
    }

    /// Records waiting in the queue (tests).
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.log.queued()
    }

    /// Wait until the queue has room (accept loops call this so a flood of
    /// connections waits instead of piling up records).
    pub async fn wait_capacity(&self) {
        if let Ok(p) = self.log.slots.acquire().await {
            drop(p);
        }
    }

    /// Write everything pending, then a final signed `seal` record, and stop
    /// the duties thread. Later writes fail. Returns whether the seal was
    /// written.
    pub async fn seal(&self) -> bool {
        let sealed = self.log.close(true);
        self.join();
        let after = match self.after_seal.lock() {
            Ok(mut a) => a.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(f) = after {
            f();
        }
        sealed
    }

    /// Rotate the checkpoint key: a `key_rotation` record signed by the
    /// current key names `next`, which signs every checkpoint after it.
    pub(crate) fn rotate_key(&self, next: ed25519_dalek::SigningKey) -> io::Result<()> {
        self.log.rotate_key(next)
    }

    /// Hand every write's leaves and checkpoints to `sink` from now on
    /// (the witnesses' queue, [`witness`]); run `after_seal` once sealed.
    pub(crate) fn feed(&self, sink: writer::Sink, after_seal: Box<dyn FnOnce() + Send>) {
        self.log.set_sink(sink);
        if let Ok(mut a) = self.after_seal.lock() {
            *a = Some(after_seal);
        }
    }

    /// Stop without sealing, as a crash would (tests): what is pending is
    /// not written.
    #[doc(hidden)]
    pub fn abandon(&self) {
        self.log.close(false);
        self.join();
    }

    fn join(&self) {
        let handle = match self.thread.lock() {
            Ok(mut t) => t.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for Evidence {
    /// An Evidence dropped without [`Evidence::seal`] seals on the way out.
    fn drop(&mut self) {
        self.log.close(true);
        self.join();
    }
}

#[cfg(test)]
mod tests;
