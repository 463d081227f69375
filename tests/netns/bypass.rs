//! Bypass attempts behind the shipped gateway ruleset with `[bypass]
//! nflog_group` set: what the ruleset does not redirect (QUIC and other
//! UDP, direct connections to the gateway itself) is refused at once
//! (ICMP port unreachable, a TCP reset: the client sees ECONNREFUSED, not a
//! timeout), and Palisade records it from the NFLOG group as `kind =
//! "bypass"`, a flood summarised within the org's evidence budget.

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, dump, Lab, CLIENT2_IP, DEFAULT_POLICY};
use crate::transparent::{load_gateway, TRANSPARENT};

/// The group the shipped ruleset logs to (`log ... group 100`).
const GROUP: u16 = 100;
/// The org's evidence budget in these labs.
const BUDGET: u64 = 5;

fn bypass_py() -> String {
    lab::fixtures_dir().join("bypass.py").display().to_string()
}

/// A gateway lab whose Palisade reads the ruleset's NFLOG group.
fn bypass_lab() -> Lab {
    let mut lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .evidence_config(&format!("max_records_per_second_per_org = {BUDGET}"))
        .without_proxy()
        .start();
    add_bypass(&lab, GROUP);
    lab.spawn_proxy();
    lab.wait_proxy_ready();
    load_gateway(&lab);
    lab
}

/// Append `[bypass] nflog_group = GROUP` to the lab's config.
fn add_bypass(lab: &Lab, group: u16) {
    let mut cfg = std::fs::read_to_string(&lab.config_path).unwrap();
    cfg.push_str(&format!("\n[bypass]\nnflog_group = {group}\n"));
    std::fs::write(&lab.config_path, cfg).unwrap();
}

/// `bypass.py WHAT ARGS` in the sandbox: its one line of output.
fn attempt(lab: &Lab, args: &[&str]) -> String {
    let py = bypass_py();
    let mut all = vec![py.as_str()];
    all.extend_from_slice(args);
    let out = lab.client_exec("python3", &all);
    assert!(out.success(), "{}", out.describe());
    out.stdout.trim().to_string()
}

/// The source `ip:port` of a "refused SRC" line, asserting the refusal.
fn refused(line: &str, what: &str) -> String {
    let src = line
        .strip_prefix("refused ")
        .unwrap_or_else(|| panic!("{what}: not refused at once: {line}"));
    src.to_string()
}

fn bypass_records(lab: &Lab) -> Vec<Value> {
    lab.evidence()
        .into_iter()
        .filter(|v| v["kind"] == "bypass")
        .collect()
}

#[test]
fn quic_udp_and_direct_gateway_connections_are_refused_at_once_and_recorded() {
    let lab = bypass_lab();
    // QUIC to an allowed web host, other UDP to it, UDP to the gateway
    // itself, a TCP connection straight to the transparent listener.
    let quic = refused(
        &attempt(&lab, &["quic", lab::ALLOWED_IP, "443"]),
        "QUIC Initial",
    );
    let ntp = refused(&attempt(&lab, &["udp", lab::ALLOWED_IP, "123"]), "UDP 123");
    let gw_udp = refused(
        &attempt(&lab, &["udp", "198.18.1.1", "9999"]),
        "UDP to the gateway",
    );
    let gw_tcp = refused(
        &attempt(&lab, &["tcp", "198.18.1.1", "15001"]),
        "TCP to the gateway",
    );

    for (src, ip, port, proto, reason) in [
        (&quic, lab::ALLOWED_IP, 443, "udp", "protocol_mismatch"),
        (&ntp, lab::ALLOWED_IP, 123, "udp", "protocol_mismatch"),
        (&gw_udp, "198.18.1.1", 9999, "udp", "protocol_mismatch"),
        (&gw_tcp, "198.18.1.1", 15001, "tcp", "port_not_allowed"),
    ] {
        let rec = lab.wait_evidence(&format!("bypass record of {proto} {ip}:{port}"), |v| {
            v["kind"] == "bypass" && v["ip"] == ip && v["port"] == port
        });
        assert_eq!(rec["org"], "acme", "{rec}");
        assert_eq!(rec["client"], src.as_str(), "{rec}");
        assert_eq!(rec["proto"], proto, "{rec}");
        assert_eq!(rec["host"], ip, "{rec}");
        assert_eq!(rec["decision"], "deny", "{rec}");
        assert_eq!(rec["reason"], reason, "{rec}");
        assert_eq!(rec["mode"], "transparent", "{rec}");
        assert!(rec["count"].as_u64() >= Some(1), "{rec}");
    }
    // Nothing reached the upstream; the metric counted by org and protocol.
    lab.assert_nothing_reached_upstream("bypass attempts");
    let metrics = lab.exec(
        &lab.ns_proxy,
        "curl",
        &[
            "-sS",
            "--max-time",
            "3",
            &format!("http://{}/metrics", lab::ADMIN_ADDR),
        ],
    );
    let line = |proto: &str| {
        metrics
            .stdout
            .lines()
            .find(|l| {
                l.starts_with("palisade_bypass_attempts_total")
                    && l.contains("org=\"acme\"")
                    && l.contains(&format!("proto=\"{proto}\""))
            })
            .map(|l| l.rsplit(' ').next().unwrap_or("").to_string())
    };
    assert_eq!(line("udp").as_deref(), Some("3"), "{}", metrics.stdout);
    assert_eq!(line("tcp").as_deref(), Some("1"), "{}", metrics.stdout);
    assert!(
        !metrics.stdout.contains("198.18."),
        "no addresses in labels:\n{}",
        metrics.stdout
    );
}

#[test]
fn a_flood_of_bypass_attempts_is_summarised_within_the_orgs_budget() {
    let lab = bypass_lab();
    // 60 datagrams to 60 ports, from one socket, as fast as it sends.
    const FLOOD: u64 = 60;
    let sent = attempt(
        &lab,
        &["flood", lab::ALLOWED_IP, "20000", &FLOOD.to_string()],
    );
    assert_eq!(sent, format!("sent {FLOOD}"));
    let is_flood = |v: &Value| {
        v["kind"] == "bypass"
            && v["org"] == "acme"
            && v["proto"] == "udp"
            && (v["client"].is_null()
                || v["port"]
                    .as_u64()
                    .is_some_and(|p| (20000..20000 + FLOOD).contains(&p)))
    };
    let counted = |records: &[Value]| -> u64 {
        records
            .iter()
            .filter(|v| is_flood(v))
            .map(|v| v["count"].as_u64().unwrap_or(0))
            .sum()
    };
    lab::wait_until(
        "every flood packet counted in a record",
        Duration::from_secs(10),
        || counted(&bypass_records(&lab)) >= FLOOD,
    );
    let records: Vec<Value> = bypass_records(&lab).into_iter().filter(is_flood).collect();
    assert_eq!(
        counted(&records),
        FLOOD,
        "nothing lost, nothing twice:\n{}",
        dump(&records)
    );
    // Not one record each: per second, the budget's targets and one
    // overflow record; the flood may straddle two seconds.
    assert!(
        (records.len() as u64) <= 2 * (BUDGET + 1),
        "{} records for {FLOOD} packets:\n{}",
        records.len(),
        dump(&records)
    );
    let overflow: Vec<&Value> = records.iter().filter(|v| v["client"].is_null()).collect();
    assert!(!overflow.is_empty(), "{}", dump(&records));
    for o in overflow {
        assert!(o["count"].as_u64() > Some(1), "{o}");
        assert!(o["window"].is_array(), "{o}");
    }
}

#[test]
fn an_nflog_group_taken_by_another_listener_fails_start_up_with_one_line() {
    let mut lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .without_proxy()
        .start();
    add_bypass(&lab, GROUP);
    // Another listener holds the group in the proxy's namespace.
    let mut holder = lab::sanitize(Command::new("ip").args([
        "netns",
        "exec",
        &lab.ns_proxy,
        "python3",
        &bypass_py(),
        "hold",
        &GROUP.to_string(),
        "30",
    ]))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let mut first = String::new();
    {
        use std::io::BufRead;
        let stdout = holder.stdout.take().unwrap();
        let _ = std::io::BufReader::new(stdout).read_line(&mut first);
    }
    assert_eq!(first.trim(), "bound", "the holder did not bind the group");
    lab.spawn_proxy();
    let status = lab.wait_proxy_exit(Duration::from_secs(10));
    let _ = holder.kill();
    let _ = holder.wait();
    let status = status.expect("palisade kept running with its group taken");
    assert!(!status.success(), "{status}");
    let output = lab.proxy_output();
    let errors: Vec<&str> = output
        .lines()
        .filter(|l| l.contains("nflog_group"))
        .collect();
    assert_eq!(errors.len(), 1, "{output}");
    assert!(
        errors[0].contains("[bypass] nflog_group 100: the group is taken by another listener"),
        "{output}"
    );
    assert!(!output.contains("palisade serving"), "{output}");
}

#[test]
fn an_nflog_group_without_permission_fails_start_up_with_one_line() {
    let lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .without_proxy()
        .start();
    add_bypass(&lab, GROUP);
    // Palisade without CAP_NET_ADMIN (dropped from the bounding set, so
    // the exec does not regain it).
    let cfg = lab.config_path.display().to_string();
    let out = lab::run_with_timeout(
        lab::sanitize(Command::new("ip").args([
            "netns",
            "exec",
            &lab.ns_proxy,
            "setpriv",
            "--bounding-set",
            "-net_admin",
            "--inh-caps",
            "-net_admin",
            "--",
            lab::palisade_bin(),
            "run",
            "-c",
            &cfg,
        ])),
        None,
        Duration::from_secs(20),
    );
    assert!(!out.success(), "{}", out.describe());
    let text = format!("{}{}", out.stdout, out.stderr);
    let errors: Vec<&str> = text.lines().filter(|l| l.contains("nflog_group")).collect();
    assert_eq!(errors.len(), 1, "{}", out.describe());
    assert!(
        errors[0].contains("[bypass] nflog_group 100: no permission to bind it"),
        "{}",
        out.describe()
    );
    assert!(!text.contains("palisade serving"), "{}", out.describe());
}

#[test]
fn without_the_key_the_ruleset_still_rejects_and_nothing_is_recorded() {
    let lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .start();
    load_gateway(&lab);
    refused(
        &attempt(&lab, &["quic", lab::ALLOWED_IP, "443"]),
        "QUIC Initial",
    );
    // A recorded allow through the same gateway after it: the marker.
    let ok = lab.client_exec(
        "curl",
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--resolve",
            "allowed.test:80:198.18.2.10",
            "http://allowed.test/after-quic",
        ],
    );
    assert_eq!(ok.stdout, "200", "{}", ok.describe());
    lab.wait_evidence("the allow after the QUIC attempt", |v| {
        v["mode"] == "transparent" && v["decision"] == "allow"
    });
    assert!(
        bypass_records(&lab).is_empty(),
        "{}",
        dump(&bypass_records(&lab))
    );
    let metrics = lab.exec(
        &lab.ns_proxy,
        "curl",
        &[
            "-sS",
            "--max-time",
            "3",
            &format!("http://{}/metrics", lab::ADMIN_ADDR),
        ],
    );
    assert!(
        metrics
            .stdout
            .lines()
            .filter(|l| l.starts_with("palisade_bypass_attempts_total{"))
            .all(|l| l.ends_with(" 0")),
        "{}",
        metrics.stdout
    );
}

/// Two orgs, one per sandbox namespace.
const TWO_ORGS: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
ports = [443]

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
[[org.allow]]
host = "allowed.test"
ports = [443]
"#;

/// Logs every UDP datagram either sandbox sends through the gateway to
/// NFLOG group [`GROUP`], as the shipped ruleset's chain `bypass` does,
/// but with no rate limit in front (the shipped 100 a second would cap the
/// flood before Palisade sees it), and drops it.
const LOG_ALL_UDP: &str = r#"
table inet pltest_bypass {
    chain pre {
        type filter hook prerouting priority filter; policy accept;
        iifname { "p0", "p1" } meta l4proto udp log prefix "palisade-bypass " group 100
        iifname { "p0", "p1" } meta l4proto udp drop
    }
}
"#;

#[test]
fn one_orgs_bypass_flood_leaves_another_orgs_attempts_their_detail() {
    let mut lab = Lab::builder()
        .policy(TWO_ORGS)
        .evidence_config("max_records_per_second_per_org = 100000")
        .second_client()
        .without_proxy()
        .start();
    add_bypass(&lab, GROUP);
    lab.spawn_proxy();
    lab.wait_proxy_ready();
    let out = lab::run_with_timeout(
        Command::new("ip").args(["netns", "exec", &lab.ns_proxy, "nft", "-f", "-"]),
        Some(LOG_ALL_UDP.as_bytes()),
        Duration::from_secs(10),
    );
    assert!(out.success(), "nft: {}", out.describe());
    let _ = lab.client_exec("ip", &["route", "add", "default", "via", "198.18.1.1"]);
    // Acme: 12,000 datagrams to 12,000 ports, spread over 1.5 s (so that
    // every one-second summary window holds thousands of acme's tallies);
    // beta, at the same time: 25 datagrams to 25 ports.
    const ACME: u64 = 12_000;
    const BETA: u64 = 25;
    let py = bypass_py();
    let acme = Command::new("ip")
        .args(["netns", "exec", &lab.ns_client, "python3", &py, "spread"])
        .args([lab::ALLOWED_IP, "20000", &ACME.to_string(), "1.5"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start acme's flood");
    let beta = lab.exec(
        &lab.ns_client2.clone(),
        "python3",
        &[
            &py,
            "spread",
            lab::ALLOWED_IP,
            "7000",
            &BETA.to_string(),
            "1.5",
        ],
    );
    assert!(beta.success(), "{}", beta.describe());
    assert_eq!(beta.stdout.trim(), format!("sent {BETA}"));
    let acme_out = acme.wait_with_output().expect("acme's flood");
    let acme_sent = String::from_utf8_lossy(&acme_out.stdout).trim().to_string();
    assert_eq!(acme_sent, format!("sent {ACME}"));
    let counted = |org: &str| -> u64 {
        bypass_records(&lab)
            .iter()
            .filter(|v| v["org"] == org)
            .map(|v| v["count"].as_u64().unwrap_or(0))
            .sum()
    };
    lab::wait_until(
        "beta's attempts counted in records",
        Duration::from_secs(15),
        || counted("beta") >= BETA,
    );
    let records = bypass_records(&lab);
    let beta: Vec<&Value> = records.iter().filter(|v| v["org"] == "beta").collect();
    let acme_overflow: u64 = records
        .iter()
        .filter(|v| v["org"] == "acme" && v["client"].is_null())
        .map(|v| v["count"].as_u64().unwrap_or(0))
        .sum();
    let beta_bare: Vec<&&Value> = beta.iter().filter(|v| v["client"].is_null()).collect();
    eprintln!(
        "bypass: acme {} packets recorded ({acme_overflow} in its overflow tallies), \
         beta {} in {} records, {} without destination, port or source",
        counted("acme"),
        counted("beta"),
        beta.len(),
        beta_bare
            .iter()
            .map(|v| v["count"].as_u64().unwrap_or(0))
            .sum::<u64>()
    );
    assert!(
        acme_overflow > 0,
        "acme's flood did not fill its share: nothing shown"
    );
    assert!(
        beta_bare.is_empty(),
        "beta's attempts lost their detail to acme's flood:\n{}",
        dump(&beta_bare.iter().map(|v| (**v).clone()).collect::<Vec<_>>())
    );
    assert_eq!(beta.len() as u64, BETA, "one record per attempt");
    for rec in &beta {
        assert_eq!(rec["count"], 1, "{rec}");
        assert!(
            rec["client"]
                .as_str()
                .is_some_and(|c| c.starts_with(&format!("{CLIENT2_IP}:"))),
            "{rec}"
        );
        assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");
        assert!(
            rec["port"]
                .as_u64()
                .is_some_and(|p| (7000..7000 + BETA).contains(&p)),
            "{rec}"
        );
        assert_eq!(rec["reason"], "protocol_mismatch", "{rec}");
        assert!(
            !rec["detail"].as_str().unwrap_or("").contains("budget"),
            "{rec}"
        );
    }
}
