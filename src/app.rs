//! Wiring: open evidence, bind every listener, serve until SIGTERM/SIGINT,
//! then drain within the grace period.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::admin::{self, Health};
use crate::bindings::Bindings;
use crate::config::Config;
use crate::dns;
use crate::evidence::Evidence;
use crate::limits::{ConnLimits, DetectMemory, EvidenceBudget};
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::proxy::{self, Ctx};
use crate::resolve::Resolver;
use crate::served::Served;

/// Time tunnels get to write their close records after the drain ends.
const HARD_STOP_GRACE: Duration = Duration::from_secs(2);

/// A start-up failure, printed as one line.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
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
    Bypass(#[from] crate::bypass::nflog::BindError),
    #[error("{0}")]
    Host(#[from] crate::host::HostError),
    #[error("enforcement: {0}")]
    Enforcement(String),
}

async fn bind(addr: SocketAddr, what: &'static str) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, what, source })
}

/// Serve until a shutdown signal; returns once drained.
pub(crate) async fn run(config: Config) -> Result<(), StartError> {
    let Config {
        path: _,
        proxy: proxy_config,
        dns,
        admin: admin_config,
        evidence: evidence_config,
        intercept: _,
        bypass: bypass_config,
        // Compiled into the policy (`Policy::with_host`).
        policy: _,
        enforcement: enforcement_config,
        orgs: _,
    } = &config;

    let evidence =
        Arc::new(
            Evidence::start(evidence_config).map_err(|source| StartError::Evidence {
                dir: evidence_config.dir.display().to_string(),
                source,
            })?,
        );
    if evidence_config.durability == crate::config::Durability::Discard {
        warn!("[evidence] durability = \"discard\": evidence goes to /dev/null; for measurements only");
    }
    // The one metrics value: everything that counts gets it from here.
    let metrics = Arc::new(Metrics::new(evidence.live().clone()));
    metrics.init_series(config.orgs.iter().map(|o| o.name.as_str()));
    let resolver = Arc::new(
        Resolver::new(&dns.upstream, dns.resolve_timeout.get())
            .map_err(|e| StartError::Resolver(e.to_string()))?
            .with_metrics(metrics.clone()),
    );
    // What a reload changes: the policy, and the per-org CAs, credentials
    // (read from their files or environment variables now) and upstream
    // trust bundle of interception. Files are read off the runtime.
    // The host's own addresses, always denied: no list, no start.
    let host = crate::host::addresses()?;
    let served = {
        let (config, metrics) = (config.clone(), metrics.clone());
        tokio::task::spawn_blocking(move || {
            let policy = Arc::new(Policy::with_host(&config, &host));
            crate::reload::store_policy_text(&config.evidence.dir, &config, policy.hash());
            Served::load(&config, policy, &metrics)
        })
        .await
        .map_err(|e| StartError::Intercept(e.to_string()))?
        .map_err(|e| StartError::Intercept(e.to_string()))?
        .into_handle()
    };
    let policy = served.load().policy.clone();
    // `[enforcement]`: the ruleset checked before anything is served; a
    // required one that is not loaded stops the start.
    let enforcement = match enforcement_config {
        Some(e) => Some(start_enforcement(e, &evidence, &metrics, policy.hash_arc()).await?),
        None => None,
    };
    // Addresses the DNS shim handed out, per org and name: the transparent
    // proxy checks connections against these.
    let bindings = Arc::new(Bindings::new(
        dns.max_bindings_per_name,
        dns.max_bindings_per_org,
        dns.max_bindings,
    ));
    // Synthetic answers' pool addresses, per org and name (none without a pool).
    let synthetic = crate::synthetic::Synthetic::from_config(dns).map(Arc::new);
    let dns_listeners =
        dns::bind(&dns.listen)
            .await
            .map_err(|(addr, source)| StartError::Bind {
                addr,
                what: "dns",
                source,
            })?;

    // `[bypass]`: the ruleset's NFLOG group, bound before anything is
    // served (fail closed: the operator asked for the record).
    let nflog = match bypass_config.nflog_group {
        Some(group) => Some(crate::bypass::nflog::NflogSocket::bind(group)?),
        None => None,
    };

    let mut proxy_listeners = Vec::new();
    for addr in &proxy_config.listen {
        proxy_listeners.push(bind(*addr, "proxy").await?);
    }
    let mut transparent_listeners = Vec::new();
    for addr in &proxy_config.transparent {
        transparent_listeners.push(bind(*addr, "transparent").await?);
    }
    let mut socks5_listeners = Vec::new();
    for addr in &proxy_config.socks5 {
        socks5_listeners.push(bind(*addr, "socks5").await?);
    }
    let admin_listener = match admin_config.listen {
        Some(addr) => {
            Some(
                std::net::TcpListener::bind(addr).map_err(|source| StartError::Bind {
                    addr,
                    what: "admin",
                    source,
                })?,
            )
        }
        None => None,
    };

    let mut sigterm = signal(SignalKind::terminate()).map_err(StartError::Signal)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(StartError::Signal)?;
    let mut sighup = signal(SignalKind::hangup()).map_err(StartError::Signal)?;

    let shutdown = CancellationToken::new();
    let hard_stop = CancellationToken::new();
    let tasks = TaskTracker::new();
    let limits = proxy_config.limits.clone();
    // One evidence budget per org, charged by the proxy and the DNS shim;
    // an org over its share of a full store is refused whatever is left
    // of it. The shares are counted over the orgs served now.
    let payers = served.clone();
    evidence
        .live()
        .store()
        .count_payers(move || payers.load().policy.org_count() + 1);
    let evidence_budget = Arc::new(
        EvidenceBudget::new(evidence_config.max_records_per_second_per_org)
            .with_store(evidence.live().clone()),
    );
    // One set of new-name budgets: a name counts once, by DNS or by
    // connection.
    let names = Arc::new(crate::limits::NameBudgets::new(
        crate::limits::names::MAX_NAMES_PER_ORG,
        Some(metrics.new_names_total.clone()),
    ));
    let ctx = Arc::new(Ctx {
        conns: ConnLimits::new(&limits, metrics.active_connections.clone()),
        denials: proxy::denials::Denials::new(
            limits.max_denial_records_per_second_per_client,
            limits.max_denial_records_per_second_per_org,
            evidence_budget.clone(),
        ),
        refusal_drains: Arc::new(tokio::sync::Semaphore::new(proxy::MAX_REFUSAL_DRAINS)),
        detect: DetectMemory::new(&limits, proxy::tunnel::MAX_DETECT_BYTES),
        upstream_pool: Arc::new(proxy::pool::UpstreamPool::new(
            &limits,
            metrics.upstream_idle_connections.clone(),
            metrics.upstream_reused_total.clone(),
        )),
        served: served.clone(),
        evidence: evidence.clone(),
        metrics: metrics.clone(),
        resolver: resolver.clone(),
        bindings: Some(bindings.clone()),
        synthetic: synthetic.clone(),
        limits: limits.clone(),
        names: names.clone(),
        shutdown: shutdown.clone(),
        hard_stop: hard_stop.clone(),
        policy_changed: tokio::sync::watch::Sender::new(()),
        tasks: tasks.clone(),
        enforcement: enforcement.as_ref().map(|(state, _)| state.clone()),
    });

    let health = Arc::new(Health {
        listeners_bound: Default::default(),
        evidence: evidence.clone(),
        served: served.clone(),
        metrics: metrics.clone(),
        tails: crate::admin::tail::Tails::new(admin_config.tail_tokens.clone()),
        enforcement: enforcement.as_ref().map(|(state, _)| state.clone()),
    });
    let mut listener_tasks = Vec::new();
    let pool_reaper = tokio::spawn(proxy::pool::reap(
        ctx.upstream_pool.clone(),
        ctx.shutdown.clone(),
    ));
    for listener in proxy_listeners {
        listener_tasks.push(tokio::spawn(proxy::serve_explicit(ctx.clone(), listener)));
    }
    for listener in transparent_listeners {
        listener_tasks.push(tokio::spawn(proxy::transparent::serve(
            ctx.clone(),
            listener,
        )));
    }
    for listener in socks5_listeners {
        listener_tasks.push(tokio::spawn(proxy::socks5::serve(ctx.clone(), listener)));
    }
    let bypass_task = nflog.map(|socket| {
        tokio::spawn(crate::bypass::serve(
            socket,
            crate::bypass::record::Bypasses::new(
                evidence.clone(),
                metrics.clone(),
                evidence_budget.clone(),
            ),
            served.clone(),
            shutdown.clone(),
        ))
    });
    let dns_shim: dns::ShimHandle = Arc::new(
        dns::Shim::new(
            served.clone(),
            resolver.clone(),
            evidence.clone(),
            metrics.clone(),
            bindings.clone(),
            dns.clone(),
        )
        .with_evidence_budget(evidence_budget)
        .with_names(names)
        .with_synthetic(synthetic.clone()),
    );
    let enforcement_task = enforcement.map(|(state, expected)| {
        let served = served.clone();
        tokio::spawn(crate::enforcement::watch(
            state,
            expected,
            evidence.clone(),
            move || served.load().policy.hash_arc().clone(),
            enforcement_config
                .as_ref()
                .map_or(crate::config::DEFAULT_ENFORCEMENT_CHECK_INTERVAL, |e| {
                    e.check_interval
                }),
            shutdown.clone(),
        ))
    });
    let dns_task = dns::serve(dns_shim.clone(), dns_listeners, shutdown.clone());
    let admin_thread = match admin_listener {
        Some(listener) => Some(
            // Drained like the proxy: in-flight requests get the same grace.
            admin::spawn(
                listener,
                health.clone(),
                shutdown.clone(),
                limits.drain_timeout.get(),
            )
            .map_err(|source| StartError::Bind {
                addr: admin_config.listen.unwrap_or(([0, 0, 0, 0], 0).into()),
                what: "admin",
                source,
            })?,
        ),
        None => None,
    };
    health.listeners_bound.store(true, Ordering::Relaxed);
    info!(
        proxy = ?proxy_config.listen,
        transparent = ?proxy_config.transparent,
        socks5 = ?proxy_config.socks5,
        dns = ?dns.listen,
        admin = ?admin_config.listen,
        bypass_nflog_group = ?bypass_config.nflog_group,
        evidence = %evidence.path().display(),
        evidence_key = %evidence.public_key(),
        policy = %policy.hash(),
        orgs = policy.org_count(),
        rules = policy.rule_count(),
        "palisade serving"
    );

    // Denials over a client's record rate are written as summaries, now
    // and then, and once more when every connection is drained.
    let flusher = {
        let (ctx, shutdown) = (ctx.clone(), shutdown.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(proxy::denials::SUMMARY_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tick.tick() => ctx.flush_denials().await,
                }
            }
        })
    };

    let mut reloader =
        crate::reload::Reloader::new(config.clone(), served.clone(), metrics.clone()).await;
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
    loop {
        tokio::select! {
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
            _ = sighup.recv() => {
                let outcome = reloader.reload("SIGHUP").await;
                reloaded(&ctx, &bindings, synthetic.as_deref(), &outcome);
            }
            () = address_changed() => {
                if let Some(outcome) = reloader.host_changed().await {
                    reloaded(&ctx, &bindings, synthetic.as_deref(), &outcome);
                }
            }
            _ = config_poll.tick() => {
                if let Some(outcome) = reloader.poll().await {
                    reloaded(&ctx, &bindings, synthetic.as_deref(), &outcome);
                }
            }
        }
    }

    info!(grace = ?limits.drain_timeout.get(), "shutting down: no new connections, draining");
    health.listeners_bound.store(false, Ordering::Relaxed);
    shutdown.cancel();
    for t in listener_tasks {
        let _ = t.await;
    }
    let _ = dns_task.await;
    // Idle upstream connections are closed, so the drain does not wait on them.
    let _ = pool_reaper.await;
    tasks.close();
    if tokio::time::timeout(limits.drain_timeout.get(), tasks.wait())
        .await
        .is_err()
    {
        warn!(
            open = tasks.len(),
            "drain grace period over; closing remaining connections"
        );
        hard_stop.cancel();
        let _ = tokio::time::timeout(HARD_STOP_GRACE, tasks.wait()).await;
    }
    let _ = flusher.await;
    if let Some(t) = enforcement_task {
        let _ = t.await;
    }
    if let Some(t) = bypass_task {
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
    if evidence.seal().await {
        info!("evidence sealed");
    } else {
        warn!("evidence could not be sealed; `verify` will report an unsealed end");
    }
    if let Some(t) = admin_thread {
        let _ = tokio::task::spawn_blocking(move || t.join()).await;
    }
    info!("stopped");
    Ok(())
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
    synthetic: Option<&crate::synthetic::Synthetic>,
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
