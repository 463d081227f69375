//! Network-namespace lab for Palisade integration tests.
//!
//! Each [`Lab`] owns three fresh network namespaces that have no link to the
//! root namespace (veth pairs are created directly inside the lab
//! namespaces):
//!
//! ```text
//!  client ns                 proxy ns (ip_forward=0)            upstream ns
//!  c0 198.18.1.2/24  <---->  p0 198.18.1.1/24
//!     198.18.3.2/32 (not in any org)
//!                            u0 198.18.2.1/24  <---------->  u1 198.18.2.2/24 (DNS :53)
//!                            lo 127.0.0.1 (canary web)          198.18.2.10-.30 (web :80/:443,
//!                                                                banner+echo :2222)
//! ```
//!
//! With [`LabBuilder::ipv6`] the same links also carry IPv6 (see
//! [`V6_WEB`]): c0 2001:2:1::2/64, p0 2001:2:1::1/64, u0 2001:2:2::1/64,
//! u1 2001:2:2::2/64 (DNS :53 there too) and the web hosts of [`V6_WEB`];
//! the DNS fixture then also answers their AAAA records. Labs without it
//! have no IPv6 address beyond link-local.
//!
//! Palisade runs in the proxy namespace.  Everything is torn down on drop
//! (also when a test panics); the lab directory is kept for post-mortem when
//! the test failed.
//!
//! The parts: [`setup`] builds a lab (namespaces, links, fixtures, the
//! proxy config), [`proxy`] runs and signals Palisade in it, [`clients`]
//! drives curl, dig and raw connections from the lab namespaces, [`logs`]
//! reads fixture logs and evidence and waits for positive markers,
//! [`http`] and [`dig`] parse what clients got, [`cmd`] and [`netns`] are
//! the process and namespace plumbing underneath.

use serde_json::Value;
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Read, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

pub(crate) const PROXY_ADDR: &str = "198.18.1.1:3128";
pub(crate) const PROXY_URL: &str = "http://198.18.1.1:3128";
pub(crate) const ADMIN_ADDR: &str = "198.18.1.1:9711";
pub(crate) const CLIENT_IP: &str = "198.18.1.2";
/// Second client address, not covered by any org's `clients`.
pub(crate) const STRANGER_IP: &str = "198.18.3.2";
pub(crate) const DNS_IP: &str = "198.18.2.2";
/// Where the DNS shim listens in labs that run it (the proxy's client-side address).
pub(crate) const SHIM_IP: &str = "198.18.1.1";
/// Second sandbox namespace (see [`LabBuilder::second_client`]).
pub(crate) const CLIENT2_IP: &str = "198.18.4.2";

/// IPv6 side of a lab built with [`LabBuilder::ipv6`] (benchmarking space
/// `2001:2::/48`): the sandbox, the gateway's two sides, the resolver.
pub(crate) const CLIENT_IP6: &str = "2001:2:1::2";
pub(crate) const GATEWAY_IP6: &str = "2001:2:1::1";
pub(crate) const DNS_IP6: &str = "2001:2:2::2";
/// IPv6 web hosts: (address, the name whose AAAA record it is, if any).
/// `fd00:2::10` is unique-local (always denied), routed to the upstream
/// namespace so that a proxy that dialled it would be seen there.
pub(crate) const V6_WEB: &[(&str, Option<&str>)] = &[
    (ALLOWED_IP6, Some("allowed.test")),
    (OTHER_IP6, Some("other.test")),
    (UNLISTED_IP6, None),
    (ULA_IP6, Some("ula.test")),
];
pub(crate) const ALLOWED_IP6: &str = "2001:2:2::10";
pub(crate) const OTHER_IP6: &str = "2001:2:2::13";
pub(crate) const UNLISTED_IP6: &str = "2001:2:2::20";
pub(crate) const ULA_IP6: &str = "fd00:2::10";

/// Test web hosts and DNS records served in the upstream namespace.
pub(crate) const ALLOWED_IP: &str = "198.18.2.10";
pub(crate) const WILD_A_IP: &str = "198.18.2.11";
pub(crate) const BLOCKED_IP: &str = "198.18.2.12";
pub(crate) const OTHER_IP: &str = "198.18.2.13";
pub(crate) const WILD_APEX_IP: &str = "198.18.2.14";
/// A web host with no rule at all (used for IP-literal spellings).
pub(crate) const UNLISTED_IP: &str = "198.18.2.20";
/// A web host allowed by a cidr rule.
pub(crate) const CIDR_IP: &str = "198.18.2.30";
/// `untrusted.test`: an HTTPS upstream whose certificate comes from a CA no
/// one trusts (see [`LabBuilder::untrusted_upstream`]).
pub(crate) const UNTRUSTED_IP: &str = "198.18.2.21";
/// Every web host also serves a server-speaks-first protocol on this port:
/// it sends [`BANNER`] on accept, then echoes what it receives (30 s idle).
pub(crate) const BANNER_PORT: u16 = 2222;
pub(crate) const BANNER: &str = "SSH-2.0-test\r\n";

const WEB_IPS: &[&str] = &[
    ALLOWED_IP,
    WILD_A_IP,
    BLOCKED_IP,
    OTHER_IP,
    WILD_APEX_IP,
    UNLISTED_IP,
    CIDR_IP,
];

const DNS_RECORDS: &[(&str, &str)] = &[
    ("allowed.test", ALLOWED_IP),
    ("a.wild.test", WILD_A_IP),
    ("blocked.wild.test", BLOCKED_IP),
    ("other.test", OTHER_IP),
    ("wild.test", WILD_APEX_IP),
    ("meta.test", "169.254.169.254"),
    ("loop.test", "127.0.0.1"),
    // One always-denied and one good address, in that order.
    ("mixed.test", "127.0.0.1"),
    ("mixed.test", ALLOWED_IP),
    // bücher.test in its ASCII (punycode) form.
    ("xn--bcher-kva.test", ALLOWED_IP),
    ("untrusted.test", UNTRUSTED_IP),
    // nx.test (and every other name) -> NXDOMAIN
];

/// Further upstream DNS records: (fixture flag, "name=value").
const DNS_EXTRA: &[(&str, &str)] = &[
    // A CNAME chain leaving the allowed names: chain.test -> c1.elsewhere.test -> c2.far.test.
    ("--cname", "chain.test=c1.elsewhere.test"),
    ("--cname", "c1.elsewhere.test=c2.far.test"),
    ("--a", "c2.far.test=198.18.2.11"),
    // Rebinding: one public and one loopback address; only private ones.
    ("--a", "rebind.test=127.0.0.1"),
    ("--a", "rebind.test=198.18.2.10"),
    ("--a", "private.test=127.0.0.2"),
    ("--a", "private.test=169.254.169.254"),
    ("--aaaa", "private.test=::ffff:127.0.0.1"),
    ("--aaaa", "private.test=64:ff9b::a9fe:a9fe"),
    ("--aaaa", "private.test=::1"),
    ("--txt", "allowed.test=allowed-txt"),
    ("--txt", "other.test=other-txt"),
    ("--https", "svc.test=198.18.2.10,127.0.0.1"),
];

/// The policy most tests run with.
pub(crate) const DEFAULT_POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
host = "allowed.test"
ports = [80, 443]

[[org.allow]]
host = "*.wild.test"

[[org.allow]]
host = "meta.test"

[[org.allow]]
host = "loop.test"

[[org.allow]]
host = "nx.test"

[[org.allow]]
cidr = "198.18.2.30/32"
ports = [80]

[[org.deny]]
host = "blocked.wild.test"
"#;

/// The default policy plus [`BANNER_PORT`] on allowed.test, carried
/// `opaque`: the fixture speaks first, so no TLS or HTTP could be verified.
pub(crate) fn banner_policy() -> String {
    format!(
        "{DEFAULT_POLICY}
[[org.allow]]
id = \"banner\"
host = \"allowed.test\"
ports = [{BANNER_PORT}]
tunnel = \"opaque\"
"
    )
}

const NS_PREFIX: &str = "pltest-";
const READY_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);
/// Upper bound for any external command the harness runs.
pub(crate) const CMD_TIMEOUT: Duration = Duration::from_secs(20);

static COUNTER: AtomicU32 = AtomicU32::new(0);
/// Marker requests of [`Lab::assert_nothing_reached_upstream`].
static MARKERS: AtomicU32 = AtomicU32::new(0);
static SETUP_LOCK: Mutex<()> = Mutex::new(());
/// Held for their whole run by the tests that flood a core on purpose
/// (`noisy`, `dns_flood`), so that two floods never overlap: each one's
/// victim would be starved by the other's flood, not by its own.
pub(crate) static FLOOD_LOCK: Mutex<()> = Mutex::new(());
static CERTS: OnceLock<PathBuf> = OnceLock::new();

mod clients;
mod cmd;
mod dig;
mod http;
mod logs;
mod netns;
mod proxy;
mod setup;

pub(crate) use clients::Background;
pub(crate) use cmd::*;
pub(crate) use dig::*;
pub(crate) use http::*;
pub(crate) use logs::*;
pub(crate) use netns::*;
pub(crate) use setup::*;

/// Configuration knobs for a lab; build with [`Lab::builder`].
pub struct LabBuilder {
    policy: String,
    proxy_listen: Vec<String>,
    admin_listen: String,
    /// Further lines of the `[admin]` table.
    admin_lines: String,
    proxy_options: Vec<String>,
    start_proxy: bool,
    dns_listen: Vec<String>,
    dns_extra: String,
    second_client: bool,
    evidence_lines: String,
    evidence_tmpfs: Option<String>,
    intercept_lines: String,
    untrusted_upstream: bool,
    ipv6: bool,
    dns_records: Vec<(String, String)>,
}

impl LabBuilder {
    /// Further A records for the upstream DNS fixture: (name, IPv4 address),
    /// e.g. names a test needs resolved that the shared [`DNS_RECORDS`] do
    /// not hold.
    pub fn dns_records(mut self, records: &[(&str, &str)]) -> Self {
        self.dns_records
            .extend(records.iter().map(|(n, a)| (n.to_string(), a.to_string())));
        self
    }
    /// Give the lab an IPv6 side as well (module docs): addresses, on-link
    /// routes, web hosts on [`V6_WEB`], AAAA records, the resolver also on
    /// [`DNS_IP6`]. The sandbox gets no IPv6 default route (as with IPv4,
    /// tests that route it through the gateway add one).
    pub fn ipv6(mut self) -> Self {
        self.ipv6 = true;
        self
    }
    /// Further lines for the `[admin]` table (e.g. `tail_tokens = [...]`).
    pub fn admin_config(mut self, lines: &str) -> Self {
        self.admin_lines = lines.to_owned();
        self
    }
    /// Lines for the `[intercept]` table (e.g. `ca_dir = "..."`).
    pub fn intercept_config(mut self, lines: &str) -> Self {
        self.intercept_lines = lines.to_owned();
        self
    }
    /// Serve `untrusted.test` ([`UNTRUSTED_IP`], HTTPS on 443) with a
    /// certificate from a CA nobody trusts; its log is `untrusted.log`.
    pub fn untrusted_upstream(mut self) -> Self {
        self.untrusted_upstream = true;
        self
    }
    pub fn policy(mut self, policy: &str) -> Self {
        self.policy = policy.to_owned();
        self
    }
    pub fn proxy_listen(mut self, addrs: &[&str]) -> Self {
        self.proxy_listen = addrs.iter().map(|s| s.to_string()).collect();
        self
    }
    /// Add a `key = value` line to the `[proxy]` table, e.g.
    /// `.proxy_option("max_connections = 2")`.
    pub fn proxy_option(mut self, line: &str) -> Self {
        self.proxy_options.push(line.to_owned());
        self
    }
    /// Run the DNS shim on these addresses (default: none).
    pub fn dns_listen(mut self, addrs: &[&str]) -> Self {
        self.dns_listen = addrs.iter().map(|s| s.to_string()).collect();
        self
    }
    /// Extra `key = value` lines for the `[dns]` table.
    pub fn dns_extra(mut self, lines: &str) -> Self {
        self.dns_extra = lines.to_owned();
        self
    }
    /// A second sandbox namespace (`ns_client2`, address [`CLIENT2_IP`],
    /// default route to the proxy namespace).
    pub fn second_client(mut self) -> Self {
        self.second_client = true;
        self
    }
    /// Extra `key = value` lines for the `[evidence]` table.
    pub fn evidence_config(mut self, lines: &str) -> Self {
        self.evidence_lines = lines.to_owned();
        self
    }
    /// Run Palisade in a private mount namespace in which the evidence dir
    /// is a tmpfs of `size` (e.g. "1m"); it vanishes with the process.
    pub fn evidence_tmpfs(mut self, size: &str) -> Self {
        self.evidence_tmpfs = Some(size.to_owned());
        self
    }
    /// Set up namespaces and fixtures but do not launch Palisade.
    pub fn without_proxy(mut self) -> Self {
        self.start_proxy = false;
        self
    }
    pub fn start(self) -> Lab {
        Lab::create(self)
    }
}

pub struct Lab {
    pub id: String,
    pub dir: PathBuf,
    pub ns_client: String,
    /// Empty unless the lab was built with [`LabBuilder::second_client`].
    pub ns_client2: String,
    pub ns_proxy: String,
    pub ns_upstream: String,
    pub config_path: PathBuf,
    pub evidence_dir: PathBuf,
    fixtures: Vec<(String, Child)>,
    proxy: Option<Child>,
    namespaces: Vec<String>,
    seq: AtomicU32,
    evidence_tmpfs: Option<String>,
    ipv6: bool,
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(mut p) = self.proxy.take() {
            let _ = p.kill();
            let _ = p.wait();
        }
        for (_, mut c) in self.fixtures.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in self.namespaces.drain(..) {
            destroy_ns(&ns);
        }
        if thread::panicking() {
            eprintln!(
                "lab {} failed; logs and evidence kept in {}",
                self.id,
                self.dir.display()
            );
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}
