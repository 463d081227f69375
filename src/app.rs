//! Wiring: open evidence, bind every listener ([`start`]), serve until a
//! shutdown future completes (the command's: SIGTERM/SIGINT, [`signals`]),
//! then drain within the grace period ([`Started::serve`]). A test builds
//! the whole app on `127.0.0.1:0` the same way, with a shutdown of its
//! own, no root and no namespaces.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::admin::{self, Health};
use crate::config::Config;
use crate::dns;
use crate::enforcement::compare::Ruleset;
use crate::enforcement::Enforcement;
use crate::evidence::Evidence;
use crate::handout::bindings::Bindings;
use crate::limits::{ConnLimits, DetectMemory, EvidenceBudget, NameBudgets};
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::proxy::ctx::Routes;
use crate::proxy::{self, Ctx};
use crate::resolve::Resolver;
use crate::served::{Served, ServedHandle};

/// Time tunnels get to write their close records after the drain ends.
const HARD_STOP_GRACE: Duration = Duration::from_secs(2);

/// A start-up failure, printed as one line.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot open evidence dir {dir}: {source}")]
    Evidence { dir: String, source: std::io::Error },
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        addr: SocketAddr,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("resolver: {0}")]
    Resolver(String),
    #[error("signal handler: {0}")]
    Signal(std::io::Error),
    #[error("interception: {0}")]
    Intercept(String),
    #[error("{0}")]
    Bypass(String),
    #[error("{0}")]
    Host(String),
    #[error("enforcement: {0}")]
    Enforcement(String),
    #[error("otel: {0}")]
    Otel(String),
}

/// A proxy listener, as `TcpListener::bind` makes it, with `TCP_NODELAY`
/// set before it listens: every connection it accepts inherits the option
/// (Linux copies it to them), including those that arrive before its
/// accept loop runs ([`crate::proxy::listen`]).
async fn bind(addr: SocketAddr, what: &'static str) -> Result<TcpListener, StartError> {
    let listen = || {
        let socket = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }?;
        socket.set_reuseaddr(true)?;
        socket.set_nodelay(true)?;
        socket.bind(addr)?;
        socket.listen(1024)
    };
    listen().map_err(|source| StartError::Bind { addr, what, source })
}

/// Serve `config` until `shutdown` completes; returns once drained. The
/// command passes the process's signals ([`signals`]); a test, a future of
/// its own. A shutdown during the start stops it there: nothing is
/// served, and the evidence opened so far is sealed.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), StartError> {
    tokio::pin!(shutdown);
    let started = tokio::select! {
        started = start(config) => started?,
        () = &mut shutdown => {
            info!("shutdown during start-up: stopped before serving");
            return Ok(());
        }
    };
    started.serve(shutdown).await
}

/// SIGTERM or SIGINT, whichever comes first: the command's shutdown.
pub fn signals() -> Result<impl Future<Output = ()> + Send, StartError> {
    let mut sigterm = signal(SignalKind::terminate()).map_err(StartError::Signal)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(StartError::Signal)?;
    Ok(async move {
        tokio::select! {
            _ = sigterm.recv() => {}
            _ = sigint.recv() => {}
        }
    })
}

/// Everything opened and bound before anything is served: evidence, what
/// is served, the enforcement check, every listener. What [`start`] gives
/// and [`Started::serve`] runs; a failure of any part stops the start.
pub struct Started {
    config: Config,
    /// The services opened, shared by every part from here.
    services: Services,
    /// `[enforcement]`: the ruleset the gateway must have loaded, checked
    /// again until shutdown (`services.enforcement` holds the state).
    expected: Option<Arc<Ruleset>>,
    nflog: Option<crate::bypass::nflog::NflogSocket>,
    listeners: Listeners,
    sighup: tokio::signal::unix::Signal,
    /// The OTLP export's tasks: stopped after the chain is sealed, since
    /// it follows the evidence to its last record.
    otel_tasks: Vec<JoinHandle<()>>,
    otel_stop: CancellationToken,
    /// The grants of the evidence still held at `.1` ([`crate::jit::replay`]).
    grants: (Vec<crate::jit::grants::Grant>, std::time::SystemTime),
}

/// Every listener of the config, bound.
struct Listeners {
    dns: dns::DnsListeners,
    proxy: Vec<TcpListener>,
    transparent: Vec<TcpListener>,
    socks5: Vec<TcpListener>,
    admin: Option<std::net::TcpListener>,
}

/// Open evidence, load what is served, check the enforcement ruleset and
/// bind every listener of `config`.
pub async fn start(config: Config) -> Result<Started, StartError> {
    let evidence_config = &config.evidence;
    let evidence =
        Arc::new(
            Evidence::start(evidence_config).map_err(|source| StartError::Evidence {
                dir: evidence_config.dir.display().to_string(),
                source,
            })?,
        );
    // Each new checkpoint goes to the witnesses, off the decision path.
    crate::evidence::witness::start(&evidence, evidence_config).map_err(|source| {
        StartError::Evidence {
            dir: evidence_config.dir.display().to_string(),
            source,
        }
    })?;
    if evidence_config.durability == crate::config::Durability::Discard {
        warn!("[evidence] durability = \"discard\": evidence goes to /dev/null; for measurements only");
    }
    // The one metrics value: everything that counts gets it from here.
    let metrics = Arc::new(Metrics::new(evidence.live().clone()));
    metrics.init_series(config.orgs.iter().map(|o| o.name.as_str()));
    let resolver = Arc::new(
        Resolver::new(&config.dns.upstream, config.dns.resolve_timeout.get())
            .map_err(|e| StartError::Resolver(e.to_string()))?
            .with_metrics(metrics.clone()),
    );
    let served = load_served(&config, &metrics).await?;
    let grants = replay_grants(&evidence).await;
    // `[enforcement]`: the ruleset checked before anything is served; a
    // required one that is not loaded stops the start.
    let policy = served.load().policy.hash_arc().clone();
    let enforcement = match &config.enforcement {
        Some(e) => Some(start_enforcement(e, &evidence, &metrics, &policy).await?),
        None => None,
    };
    let dns = &config.dns;
    // Addresses the DNS shim handed out, per org and name: the transparent
    // proxy checks connections against these.
    let bindings = Arc::new(Bindings::new(
        dns.max_bindings_per_name,
        dns.max_bindings_per_org,
        dns.max_bindings,
    ));
    // Synthetic answers' pool addresses, per org and name (none without a pool).
    let synthetic = crate::handout::synthetic::Synthetic::from_config(dns).map(Arc::new);
    // `[bypass]`: the ruleset's NFLOG group, bound before anything is
    // served (fail closed: the operator asked for the record).
    let nflog = match config.bypass.nflog_group {
        Some(group) => Some(
            crate::bypass::nflog::NflogSocket::bind(group)
                .map_err(|e| StartError::Bypass(e.to_string()))?,
        ),
        None => None,
    };
    let otel_stop = CancellationToken::new();
    let otel = crate::otel::start(
        config.otel.as_ref(),
        evidence.live().tap(),
        &metrics,
        &otel_stop,
    )
    .map_err(StartError::Otel)?;
    let listeners = bind_all(&config).await?;
    let sighup = signal(SignalKind::hangup()).map_err(StartError::Signal)?;
    let (otel, otel_tasks) = match otel {
        Some((otel, tasks)) => (Some(otel), tasks),
        None => (None, Vec::new()),
    };
    let (enforcement, expected) = enforcement.unzip();
    Ok(Started {
        config,
        services: Services {
            evidence,
            metrics,
            resolver,
            served,
            bindings,
            synthetic,
            enforcement,
            routes: Routes::default(),
            otel,
        },
        expected,
        nflog,
        listeners,
        sighup,
        otel_tasks,
        otel_stop,
        grants,
    })
}

/// The grants of the evidence still held now, read off the runtime (so a
/// signal stops a slow start): only the recent segments are read
/// ([`crate::jit::replay`]).
async fn replay_grants(
    evidence: &Evidence,
) -> (Vec<crate::jit::grants::Grant>, std::time::SystemTime) {
    let now = std::time::SystemTime::now();
    let dir = evidence.path().to_path_buf();
    let held = tokio::task::spawn_blocking(move || crate::jit::replay(&dir, now)).await;
    (held.unwrap_or_default(), now)
}

/// What is served at the start: the policy, and the per-org CAs,
/// credentials (read from their files or environment variables now) and
/// upstream trust bundle of interception; what a reload changes. Files
/// are read off the runtime. The host's own addresses are always denied:
/// no list, no start.
async fn load_served(config: &Config, metrics: &Arc<Metrics>) -> Result<ServedHandle, StartError> {
    let host = crate::host::addresses().map_err(|e| StartError::Host(e.to_string()))?;
    let (config, metrics) = (config.clone(), metrics.clone());
    Ok(tokio::task::spawn_blocking(move || {
        let policy = Arc::new(Policy::with_host(&config, &host).at(std::time::SystemTime::now()));
        crate::reload::store_policy_text(&config.evidence.dir, &config, policy.hash());
        Served::load(&config, policy, &metrics)
    })
    .await
    .map_err(|e| StartError::Intercept(e.to_string()))?
    .map_err(|e| StartError::Intercept(e.to_string()))?
    .into_handle())
}

/// Bind every listener of `config`; the first failure names its address.
async fn bind_all(config: &Config) -> Result<Listeners, StartError> {
    let dns = dns::bind(&config.dns.listen)
        .await
        .map_err(|(addr, source)| StartError::Bind {
            addr,
            what: "dns",
            source,
        })?;
    let mut listeners = Listeners {
        dns,
        proxy: Vec::new(),
        transparent: Vec::new(),
        socks5: Vec::new(),
        admin: None,
    };
    let proxy = &config.proxy;
    for addr in &proxy.listen {
        listeners.proxy.push(bind(*addr, "proxy").await?);
    }
    for addr in &proxy.transparent {
        listeners
            .transparent
            .push(bind(*addr, "transparent").await?);
    }
    for addr in &proxy.socks5 {
        listeners.socks5.push(bind(*addr, "socks5").await?);
    }
    if let Some(addr) = config.admin.listen {
        let admin = std::net::TcpListener::bind(addr).map_err(|source| StartError::Bind {
            addr,
            what: "admin",
            source,
        })?;
        listeners.admin = Some(admin);
    }
    Ok(listeners)
}

/// The addresses `listeners` are bound to (port 0 in the config: the one
/// the system chose).
fn bound(listeners: &[TcpListener]) -> Vec<SocketAddr> {
    listeners
        .iter()
        .filter_map(|l| l.local_addr().ok())
        .collect()
}

impl Started {
    /// The explicit proxy's listening addresses.
    pub fn proxy_addrs(&self) -> Vec<SocketAddr> {
        bound(&self.listeners.proxy)
    }

    /// The SOCKS5 listening addresses.
    pub fn socks5_addrs(&self) -> Vec<SocketAddr> {
        bound(&self.listeners.socks5)
    }

    /// The admin listener's address, if one is configured.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.listeners.admin.as_ref()?.local_addr().ok()
    }

    /// Dial `to` wherever a checked decision dials `from` (after the
    /// decision, which is made and recorded on `from` as ever). For tests
    /// of the whole proxy without root or namespaces: the policy denies
    /// loopback, so a test's upstream on 127.0.0.1 stands in for an
    /// allowed address. The command never calls it.
    pub fn route_upstream(mut self, from: SocketAddr, to: SocketAddr) -> Started {
        self.services.routes.insert(from, to);
        self
    }

    /// Serve until `shutdown` completes, then drain within the grace
    /// period and seal the evidence.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), StartError> {
        let Started {
            config,
            services,
            expected,
            nflog,
            listeners,
            mut sighup,
            otel_tasks,
            otel_stop,
            grants,
        } = self;
        let (ctx, evidence_budget, names) = context(&config, &services, grants);
        let health = health(&config, &services, &ctx);
        let mut running = spawn_proxy(
            &ctx,
            listeners.proxy,
            listeners.transparent,
            listeners.socks5,
        );
        running.otel = (otel_stop, otel_tasks);
        // Drained like the proxy: in-flight requests get the same grace.
        if let Some(listener) = listeners.admin {
            let limits = &config.proxy.limits;
            let spawned = admin::spawn(
                listener,
                health.clone(),
                ctx.shutdown.clone(),
                limits.drain_timeout.get(),
            );
            match spawned {
                Ok(thread) => running.admin = Some(thread),
                Err(source) => {
                    ctx.shutdown.cancel();
                    drain(&ctx, running, limits).await;
                    return Err(StartError::Bind {
                        addr: config.admin.listen.unwrap_or(([0, 0, 0, 0], 0).into()),
                        what: "admin",
                        source,
                    });
                }
            }
        }
        running.bypass = nflog.map(|socket| {
            tokio::spawn(crate::bypass::serve(
                socket,
                crate::bypass::record::Bypasses::new(
                    services.evidence.clone(),
                    services.metrics.clone(),
                    evidence_budget.clone(),
                ),
                services.served.clone(),
                ctx.shutdown.clone(),
            ))
        });
        let dns_shim = dns_shim(&config, &services, &ctx, evidence_budget, names);
        running.enforcement = (services.enforcement.clone())
            .zip(expected)
            .map(|e| watch_enforcement(&config, &services, &ctx, e));
        running.dns = Some(dns::serve(dns_shim, listeners.dns, ctx.shutdown.clone()));
        health.listeners_bound.store(true, Ordering::Relaxed);
        log_serving(&config, &services);
        running.flusher = Some(flush_denials(&ctx));
        running.grants = Some(end_grants(&ctx));

        serve_until(&config, &ctx, &services, &mut sighup, shutdown).await;

        info!(grace = ?config.proxy.limits.drain_timeout.get(), "shutting down: no new connections, draining");
        health.listeners_bound.store(false, Ordering::Relaxed);
        drain(&ctx, running, &config.proxy.limits).await;
        info!("stopped");
        Ok(())
    }
}

/// What the admin endpoints read: the services, the tail tokens, the
/// approvers of just-in-time grants.
fn health(config: &Config, s: &Services, ctx: &Ctx) -> Arc<Health> {
    Arc::new(Health {
        listeners_bound: Default::default(),
        evidence: s.evidence.clone(),
        served: s.served.clone(),
        metrics: s.metrics.clone(),
        tails: crate::admin::tail::Tails::new(config.admin.tail_tokens.clone()),
        enforcement: s.enforcement.clone(),
        volumes: ctx.volumes.clone(),
        approvers: crate::admin::approvals::Approvers {
            jit: ctx.jit.clone(),
            tokens: config.admin.approver_tokens.clone(),
            served: s.served.clone(),
        },
        sessions: Default::default(),
    })
}

/// The DNS shim over the shared services, paying the proxy's evidence
/// and name budgets.
fn dns_shim(
    config: &Config,
    s: &Services,
    ctx: &Ctx,
    evidence_budget: Arc<EvidenceBudget>,
    names: Arc<NameBudgets>,
) -> dns::ShimHandle {
    Arc::new(
        dns::Shim::new(
            s.served.clone(),
            s.resolver.clone(),
            s.evidence.clone(),
            s.metrics.clone(),
            s.bindings.clone(),
            config.dns.clone(),
        )
        .with_evidence_budget(evidence_budget)
        .with_names(names)
        .with_synthetic(s.synthetic.clone())
        .with_jit(ctx.jit.clone()),
    )
}

/// The task that checks the loaded nftables ruleset against `expected`
/// until shutdown.
fn watch_enforcement(
    config: &Config,
    s: &Services,
    ctx: &Ctx,
    (state, expected): (Arc<Enforcement>, Arc<Ruleset>),
) -> JoinHandle<()> {
    let served = s.served.clone();
    tokio::spawn(crate::enforcement::watch(
        state,
        expected,
        s.evidence.clone(),
        move || served.load().policy.hash_arc().clone(),
        config
            .enforcement
            .as_ref()
            .map_or(crate::config::DEFAULT_ENFORCEMENT_CHECK_INTERVAL, |e| {
                e.check_interval
            }),
        ctx.shutdown.clone(),
    ))
}

/// The services every part shares, opened by [`start`].
struct Services {
    evidence: Arc<Evidence>,
    metrics: Arc<Metrics>,
    resolver: Arc<Resolver>,
    served: ServedHandle,
    bindings: Arc<Bindings>,
    synthetic: Option<Arc<crate::handout::synthetic::Synthetic>>,
    enforcement: Option<Arc<Enforcement>>,
    routes: Routes,
    otel: Option<Arc<crate::otel::Otel>>,
}

/// The proxy's context, and the evidence and new-name budgets it shares
/// with the DNS shim and the bypass records.
fn context(
    config: &Config,
    s: &Services,
    grants: (Vec<crate::jit::grants::Grant>, std::time::SystemTime),
) -> (Arc<Ctx>, Arc<EvidenceBudget>, Arc<NameBudgets>) {
    let limits = config.proxy.limits.clone();
    // One evidence budget per org, charged by the proxy and the DNS shim;
    // an org over its share of a full store is refused whatever is left
    // of it. The shares are counted over the orgs served now.
    let payers = s.served.clone();
    s.evidence
        .live()
        .store()
        .count_payers(move || payers.load().policy.org_count() + 1);
    let evidence_budget = Arc::new(
        EvidenceBudget::new(config.evidence.max_records_per_second_per_org)
            .with_store(s.evidence.live().clone()),
    );
    // One set of new-name budgets: a name counts once, by DNS or by
    // connection.
    let names = Arc::new(NameBudgets::new(
        crate::limits::names::MAX_NAMES_PER_ORG,
        Some(s.metrics.new_names_total.clone()),
    ));
    // Volume budgets count from now; kept across reloads (by org and
    // rule id).
    let volumes = Arc::new(crate::limits::Volumes::new(
        std::time::Instant::now(),
        crate::limits::volume::MAX_METERS,
        Some(s.metrics.volume_exceeded_total.clone()),
    ));
    let ctx = Arc::new(Ctx {
        volumes,
        conns: ConnLimits::new(&limits, s.metrics.active_connections.clone()),
        denials: proxy::denials::Denials::new(
            limits.max_denial_records_per_second_per_client,
            limits.max_denial_records_per_second_per_org,
            evidence_budget.clone(),
        ),
        refusal_drains: Arc::new(tokio::sync::Semaphore::new(proxy::MAX_REFUSAL_DRAINS)),
        detect: DetectMemory::new(&limits, proxy::tunnel::MAX_DETECT_BYTES),
        upstream_pool: Arc::new(proxy::pool::UpstreamPool::new(
            &limits,
            s.metrics.upstream_idle_connections.clone(),
            s.metrics.upstream_reused_total.clone(),
        )),
        served: s.served.clone(),
        evidence: s.evidence.clone(),
        metrics: s.metrics.clone(),
        resolver: s.resolver.clone(),
        bindings: Some(s.bindings.clone()),
        synthetic: s.synthetic.clone(),
        limits,
        names: names.clone(),
        shutdown: CancellationToken::new(),
        hard_stop: CancellationToken::new(),
        policy_changed: tokio::sync::watch::Sender::new(()),
        tasks: TaskTracker::new(),
        enforcement: s.enforcement.clone(),
        routes: s.routes.clone(),
        otel: s.otel.clone(),
        jit: jit(config, s, grants),
    });
    (ctx, evidence_budget, names)
}

/// Approvals and grants, with the grants of the evidence taken back
/// (`held` at `now`, [`replay_grants`]): an unexpired one lives on
/// exactly as given, an expired one is recorded `expired` and dropped;
/// the decider (restart-only) consulted on a miss.
fn jit(
    config: &Config,
    s: &Services,
    (held, now): (Vec<crate::jit::grants::Grant>, std::time::SystemTime),
) -> Arc<crate::jit::Jit> {
    let decider = config.decider.as_ref().map(crate::decider::Decider::new);
    let jit = Arc::new(crate::jit::Jit::new(Some(s.evidence.clone())).with_decider(decider));
    jit.restore(held, &s.served.load().policy, now);
    jit
}

/// End grants as they fall due (their TTL; a reload that denies their
/// target), checked four times a second, until shutdown.
fn end_grants(ctx: &Arc<Ctx>) -> tokio::task::JoinHandle<()> {
    every(ctx, crate::jit::END_CHECK, |ctx| async move {
        let served = ctx.served.load();
        ctx.jit
            .end_due(&served.policy, std::time::SystemTime::now());
    })
}

/// A task doing `work` every `period` (a late tick is not caught up)
/// until shutdown.
fn every<F, W>(ctx: &Arc<Ctx>, period: Duration, work: F) -> JoinHandle<()>
where
    F: Fn(Arc<Ctx>) -> W + Send + 'static,
    W: Future<Output = ()> + Send + 'static,
{
    let ctx = ctx.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ctx.shutdown.cancelled() => return,
                _ = tick.tick() => work(ctx.clone()).await,
            }
        }
    })
}

/// What runs until the drain, to be waited for in order.
#[derive(Default)]
struct Running {
    listeners: Vec<JoinHandle<()>>,
    pool_reaper: Option<JoinHandle<()>>,
    bypass: Option<JoinHandle<()>>,
    enforcement: Option<JoinHandle<()>>,
    dns: Option<JoinHandle<()>>,
    flusher: Option<JoinHandle<()>>,
    /// Ends grants at their TTL (`crate::jit`).
    grants: Option<JoinHandle<()>>,
    admin: Option<std::thread::JoinHandle<()>>,
    /// The OTLP export's stop and tasks: stopped once the chain is sealed.
    otel: (CancellationToken, Vec<JoinHandle<()>>),
}

/// Serve every proxy listener, and reap idle upstream connections.
fn spawn_proxy(
    ctx: &Arc<Ctx>,
    proxy_listeners: Vec<TcpListener>,
    transparent: Vec<TcpListener>,
    socks5: Vec<TcpListener>,
) -> Running {
    let mut running = Running {
        pool_reaper: Some(tokio::spawn(proxy::pool::reap(
            ctx.upstream_pool.clone(),
            ctx.shutdown.clone(),
        ))),
        ..Running::default()
    };
    for listener in proxy_listeners {
        let task = tokio::spawn(proxy::serve_explicit(ctx.clone(), listener));
        running.listeners.push(task);
    }
    for listener in transparent {
        let task = tokio::spawn(proxy::transparent::serve(ctx.clone(), listener));
        running.listeners.push(task);
    }
    for listener in socks5 {
        let task = tokio::spawn(proxy::socks5::serve(ctx.clone(), listener));
        running.listeners.push(task);
    }
    running
}

/// One line: what is served, where.
fn log_serving(config: &Config, s: &Services) {
    let policy = s.served.load().policy.clone();
    info!(
        proxy = ?config.proxy.listen,
        transparent = ?config.proxy.transparent,
        socks5 = ?config.proxy.socks5,
        dns = ?config.dns.listen,
        admin = ?config.admin.listen,
        bypass_nflog_group = ?config.bypass.nflog_group,
        evidence = %s.evidence.path().display(),
        evidence_key = %s.evidence.public_key(),
        policy = %policy.hash(),
        orgs = policy.org_count(),
        rules = policy.rule_count(),
        "palisade serving"
    );
}

/// Denials over a client's record rate are written as summaries, now and
/// then, until shutdown (and once more when every connection is drained).
fn flush_denials(ctx: &Arc<Ctx>) -> JoinHandle<()> {
    every(ctx, proxy::denials::SUMMARY_INTERVAL, |ctx| async move {
        ctx.flush_denials().await
    })
}

/// Serve until `shutdown`: reload on SIGHUP, on a change of the host's
/// addresses and when the config file changes.
async fn serve_until(
    config: &Config,
    ctx: &Ctx,
    s: &Services,
    sighup: &mut tokio::signal::unix::Signal,
    shutdown: impl Future<Output = ()> + Send,
) {
    let mut reloader =
        crate::reload::Reloader::new(config.clone(), s.served.clone(), s.metrics.clone()).await;
    let mut config_poll = tokio::time::interval(crate::reload::DEFAULT_CONFIG_POLL_INTERVAL);
    config_poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A new address of the gateway is denied as the kernel reports it, not
    // at the next poll (which stays, should the notices fail).
    let address_events = crate::host::AddressEvents::open()
        .inspect_err(|e| {
            warn!(error = %e, "no host address notices; the config poll alone sees address changes")
        })
        .ok();
    let address_changed = async || match &address_events {
        Some(events) => events.changed().await,
        None => std::future::pending().await,
    };
    let synthetic = s.synthetic.as_deref();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // A time-bound rule starts or ends at its instant, no reload needed.
        let rule_change = async |wait: Option<std::time::Duration>| match wait {
            Some(wait) => tokio::time::sleep(wait).await,
            None => std::future::pending().await,
        };
        tokio::select! {
            () = rule_change(reloader.until_rule_change()) => {
                if let Some(outcome) = reloader.rule_change().await {
                    reloaded(ctx, &s.bindings, synthetic, &outcome);
                }
            }
            () = &mut shutdown => break,
            _ = sighup.recv() => {
                let outcome = reloader.reload("SIGHUP").await;
                reloaded(ctx, &s.bindings, synthetic, &outcome);
            }
            () = address_changed() => {
                if let Some(outcome) = reloader.host_changed().await {
                    reloaded(ctx, &s.bindings, synthetic, &outcome);
                }
            }
            _ = config_poll.tick() => {
                if let Some(outcome) = reloader.poll().await {
                    reloaded(ctx, &s.bindings, synthetic, &outcome);
                }
            }
        }
    }
}

/// Stop accepting, let connections finish within the grace period (then
/// close what is left), write the last denial summaries, seal the
/// evidence chain, and stop the admin listener.
async fn drain(ctx: &Ctx, running: Running, limits: &crate::config::Limits) {
    ctx.shutdown.cancel();
    for t in running.listeners {
        let _ = t.await;
    }
    if let Some(t) = running.dns {
        let _ = t.await;
    }
    // Idle upstream connections are closed, so the drain does not wait on them.
    if let Some(t) = running.pool_reaper {
        let _ = t.await;
    }
    ctx.tasks.close();
    if tokio::time::timeout(limits.drain_timeout.get(), ctx.tasks.wait())
        .await
        .is_err()
    {
        warn!(
            open = ctx.tasks.len(),
            "drain grace period over; closing remaining connections"
        );
        ctx.hard_stop.cancel();
        let _ = tokio::time::timeout(HARD_STOP_GRACE, ctx.tasks.wait()).await;
    }
    for t in [
        running.flusher,
        running.enforcement,
        running.bypass,
        running.grants,
    ]
    .into_iter()
    .flatten()
    {
        let _ = t.await;
    }
    ctx.flush_denials().await;
    if ctx.denials.pending_count() > 0 {
        warn!(
            denials = ctx.denials.pending_count(),
            "denials summarised but not written before shutdown"
        );
    }
    // Everything is drained: seal the chain with a final signed checkpoint.
    if ctx.evidence.seal().await {
        info!("evidence sealed");
    } else {
        warn!("evidence could not be sealed; `verify` will report an unsealed end");
    }
    let (otel_stop, otel_tasks) = running.otel;
    otel_stop.cancel();
    for t in otel_tasks {
        let _ = t.await;
    }
    if let Some(t) = running.admin {
        let _ = tokio::task::spawn_blocking(move || t.join()).await;
    }
}
/// Read the ruleset file (as the kernel would list it) and check it
/// once; `Err` if the file does not load, or if a required ruleset is not
/// loaded as written (one line naming what differs).
async fn start_enforcement(
    config: &crate::config::EnforcementConfig,
    evidence: &Evidence,
    metrics: &Metrics,
    policy: &Arc<str>,
) -> Result<
    (
        Arc<crate::enforcement::Enforcement>,
        Arc<crate::enforcement::compare::Ruleset>,
    ),
    StartError,
> {
    use crate::enforcement::{check_now, defined, Enforcement, Found};
    let expected = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || defined(&config))
            .await
            .map_err(|e| StartError::Enforcement(e.to_string()))?
            .map_err(|e| StartError::Enforcement(e.to_string()))?
    };
    let expected = Arc::new(expected);
    let state = Arc::new(Enforcement::new(config, metrics.enforcement_gauge()));
    let found = check_now(&state, &expected, evidence, policy, true).await;
    if let (Found::NotVerified(differs), crate::config::EnforcementMode::Required) =
        (&found, config.mode)
    {
        return Err(StartError::Enforcement(format!(
            "the required ruleset {} is not loaded as written: {}",
            config.ruleset.display(),
            differs.join("; ")
        )));
    }
    Ok((state, expected))
}

/// After a reload: a new served state holds live connections to it
/// ([`proxy::revoke`]) and drops the DNS bindings it no longer allows,
/// and the synthetic mappings of orgs no longer synthetic or names no
/// longer allowed.
fn reloaded(
    ctx: &Ctx,
    bindings: &Bindings,
    synthetic: Option<&crate::handout::synthetic::Synthetic>,
    outcome: &crate::reload::ReloadOutcome,
) {
    if let crate::reload::ReloadOutcome::Applied { .. } = outcome {
        let served = ctx.served.load_full();
        let dropped = bindings.retain(|org, name| served.policy.binds(org, name));
        if dropped > 0 {
            info!(dropped, "DNS bindings the new policy denies dropped");
        }
        if let Some(synthetic) = synthetic {
            let dropped = synthetic
                .retain(|org, name| served.is_synthetic(org) && served.policy.binds(org, name));
            if dropped > 0 {
                info!(
                    dropped,
                    "synthetic DNS mappings the new policy no longer serves dropped"
                );
            }
        }
        ctx.policy_changed.send_replace(());
    }
}
