//! The truth table of the module doc, row by row.

use super::*;
use crate::config;
use crate::proto::target::normalize_host;
use std::path::Path;

const POLICY: &str = r#"
[proxy]
listen = ["198.18.0.1:3128"]
[admin]
listen = "0.0.0.0:9711"

[[org]]
name = "acme"
clients = ["198.19.1.0/24", "2001:db8::/64"]

[[org.allow]]
id = "api"
host = "api.example.com"
ports = [443]

[[org.allow]]
host = "*.example.org"

[[org.allow]]
host = "intranet.example.net"
ports = [8443]

[[org.allow]]
cidr = "198.18.7.0/24"
ports = [5432]

[[org.allow]]
cidr = "10.1.0.0/16"
ports = [443]

[[org.deny]]
host = "uploads.example.org"

[[org.deny]]
cidr = "198.18.7.66/32"

[[org]]
name = "lab"
clients = ["198.19.0.0/16"]

[[org.allow]]
host = "example.org"
"#;

fn policy() -> Policy {
    Policy::new(&config::from_str(POLICY, Path::new("p.toml")).unwrap())
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

const ACME: &str = "198.19.1.5";

/// Decide a target end to end, with `addrs` as what the name resolves to.
fn decide(p: &Policy, client: &str, target: &str, port: u16, addrs: &[&str]) -> Verdict {
    let host = normalize_host(target).unwrap();
    match p.decide(ip(client), &host, port) {
        Decision::Final(v) => v,
        Decision::Resolve(pending) => {
            let addrs: Vec<IpAddr> = addrs.iter().map(|a| ip(a)).collect();
            p.check_addresses(&pending, &addrs).verdict
        }
    }
}

fn reason(p: &Policy, target: &str, port: u16, addrs: &[&str]) -> Reason {
    decide(p, ACME, target, port, addrs).reason
}

#[test]
fn row_1_unknown_client() {
    let v = decide(
        &policy(),
        "198.20.0.1",
        "api.example.com",
        443,
        &["198.18.9.9"],
    );
    assert_eq!(v.reason, Reason::UnknownClient);
    assert_eq!(v.org, None);
}

#[test]
fn clients_map_by_longest_prefix() {
    let p = policy();
    assert_eq!(&*p.org_for(ip("198.19.1.9")).unwrap().name, "acme");
    assert_eq!(&*p.org_for(ip("198.19.2.9")).unwrap().name, "lab");
    assert_eq!(&*p.org_for(ip("2001:db8::5")).unwrap().name, "acme");
    assert_eq!(&*p.org_for(ip("::ffff:198.19.1.9")).unwrap().name, "acme");
    assert!(p.org_for(ip("127.0.0.1")).is_none());
}

#[test]
fn row_2_deny_wins_over_wildcard_allow() {
    let p = policy();
    let v = decide(&p, ACME, "uploads.example.org", 443, &["198.18.9.9"]);
    assert_eq!(v.reason, Reason::ExplicitDeny);
    assert_eq!(v.rule.as_deref(), Some("acme/deny/0"));
    assert_eq!(
        reason(&p, "UPLOADS.example.org.", 80, &["198.18.9.9"]),
        Reason::ExplicitDeny
    );
}

#[test]
fn row_3_no_matching_rule() {
    let p = policy();
    assert_eq!(
        reason(&p, "evil.com", 443, &["198.18.9.9"]),
        Reason::NoMatchingRule
    );
    // wildcard is strictly below the suffix
    assert_eq!(
        reason(&p, "example.org", 443, &["198.18.9.9"]),
        Reason::NoMatchingRule
    );
    // suffix match is by label, not by string
    assert_eq!(
        reason(&p, "badexample.org", 443, &["198.18.9.9"]),
        Reason::NoMatchingRule
    );
    assert_eq!(
        reason(&p, "api.example.com.evil.com", 443, &["198.18.9.9"]),
        Reason::NoMatchingRule
    );
}

#[test]
fn row_4_port_not_allowed() {
    let p = policy();
    assert_eq!(
        reason(&p, "api.example.com", 80, &["198.18.9.9"]),
        Reason::PortNotAllowed
    );
    assert_eq!(
        reason(&p, "a.example.org", 8080, &["198.18.9.9"]),
        Reason::PortNotAllowed
    );
}

#[test]
fn row_6_denied_addresses() {
    let p = policy();
    for bad in [
        "127.0.0.1",
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fc00::1",
        "fd12::1",
        "fe80::1",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "64:ff9b::a9fe:a9fe",
        "2002:7f00:1::1",
    ] {
        assert_eq!(
            reason(&p, "api.example.com", 443, &[bad]),
            Reason::DeniedAddress,
            "{bad}"
        );
    }
    // a deny cidr covers a resolved address
    let v = decide(&p, ACME, "a.example.org", 443, &["198.18.7.66"]);
    assert_eq!(v.reason, Reason::ExplicitDeny);
    assert_eq!(v.rule.as_deref(), Some("acme/deny/1"));
}

#[test]
fn row_7_only_passing_addresses_are_dialled() {
    let p = policy();
    let host = normalize_host("api.example.com").unwrap();
    let Decision::Resolve(pending) = p.decide(ip(ACME), &host, 443) else {
        panic!("expected resolve")
    };
    assert_eq!(pending.rule.as_deref(), Some("api"));
    let av = p.check_addresses(
        &pending,
        &[
            ip("127.0.0.1"),
            ip("198.18.9.9"),
            ip("::ffff:198.18.9.10"),
            ip("198.18.9.9"),
        ],
    );
    assert!(av.verdict.is_allow());
    assert_eq!(av.verdict.rule.as_deref(), Some("api"));
    assert_eq!(av.dial, vec![ip("198.18.9.9"), ip("198.18.9.10")]);
    // a cidr allow on the port lets an otherwise always-denied address through
    assert_eq!(
        reason(&p, "api.example.com", 443, &["10.1.2.3"]),
        Reason::RuleMatch
    );
    assert_eq!(
        reason(&p, "a.example.org", 80, &["10.1.2.3"]),
        Reason::DeniedAddress
    );
}

#[test]
fn rows_8_to_10_ip_targets() {
    let p = policy();
    let v = decide(&p, ACME, "198.18.7.5", 5432, &[]);
    assert_eq!(v.reason, Reason::RuleMatch);
    assert_eq!(v.rule.as_deref(), Some("acme/allow/3"));
    assert_eq!(reason(&p, "198.18.7.5", 80, &[]), Reason::PortNotAllowed);
    assert_eq!(reason(&p, "198.18.8.5", 5432, &[]), Reason::NoMatchingRule);
    // deny address inside an allowed cidr
    assert_eq!(reason(&p, "198.18.7.66", 5432, &[]), Reason::ExplicitDeny);
    // always-denied IP target without a covering cidr
    assert_eq!(reason(&p, "127.0.0.1", 443, &[]), Reason::DeniedAddress);
    assert_eq!(reason(&p, "10.1.0.9", 443, &[]), Reason::RuleMatch);
    // IPv4-mapped spelling is the IPv4 address
    assert_eq!(
        reason(&p, "[::ffff:198.18.7.5]", 5432, &[]),
        Reason::RuleMatch
    );
}

#[test]
fn name_rules_never_allow_ip_literals() {
    let p = policy();
    let mut c = config::from_str(POLICY, Path::new("p.toml")).unwrap();
    c.orgs[0].allow.push(config::RuleConfig {
        id: "x".into(),
        target: config::RuleTarget::Exact("198.18.9.9".into()),
        ports: config::PortSet::All,
        intercept: None,
        tunnel: None,
    });
    let p2 = Policy::new(&c);
    assert_eq!(reason(&p, "198.18.9.9", 443, &[]), Reason::NoMatchingRule);
    assert_eq!(reason(&p2, "198.18.9.9", 443, &[]), Reason::NoMatchingRule);
}

#[test]
fn own_listeners_are_never_dialled() {
    let p = policy();
    let mut c = config::from_str(POLICY, Path::new("p.toml")).unwrap();
    c.orgs[0].allow.push(config::RuleConfig {
        id: "all".into(),
        target: config::RuleTarget::Cidr("0.0.0.0/0".parse().unwrap()),
        ports: config::PortSet::All,
        intercept: None,
        tunnel: None,
    });
    let p2 = Policy::new(&c);
    assert_eq!(reason(&p2, "198.18.0.1", 3128, &[]), Reason::DeniedAddress);
    // admin listens on 0.0.0.0:9711: any address on that port is Palisade itself
    assert_eq!(reason(&p2, "198.18.5.5", 9711, &[]), Reason::DeniedAddress);
    assert_eq!(reason(&p2, "198.18.5.5", 9712, &[]), Reason::RuleMatch);
    assert_eq!(
        reason(&p, "api.example.com", 443, &["198.18.0.1"]),
        Reason::RuleMatch
    );
}

#[test]
fn first_matching_allow_rule_in_file_order_decides() {
    let src = format!("{POLICY}\n[[org.allow]]\nid = \"second\"\nhost = \"a.example.org\"\n");
    let p = Policy::new(&config::from_str(&src, Path::new("p.toml")).unwrap());
    let v = decide(&p, "198.19.2.1", "a.example.org", 443, &["198.18.9.9"]);
    assert_eq!(v.rule.as_deref(), Some("second"));
    let v = decide(&p, ACME, "a.example.org", 443, &["198.18.9.9"]);
    assert_eq!(v.rule.as_deref(), Some("acme/allow/1"));
}

#[test]
fn policy_hash_tracks_rules() {
    let a = policy();
    let b = policy();
    assert_eq!(a.hash(), b.hash());
    assert_eq!(a.hash().len(), 64);
    let src = POLICY.replace("ports = [5432]", "ports = [5433]");
    let c = Policy::new(&config::from_str(&src, Path::new("p.toml")).unwrap());
    assert_ne!(a.hash(), c.hash());
}

#[test]
fn lookup_cost_is_independent_of_rule_count() {
    // Structural check: 10,000 exact rules still answer by hash probes.
    let mut src = String::from(POLICY);
    for i in 0..10_000 {
        src.push_str(&format!("[[org.allow]]\nhost = \"h{i}.example.com\"\n"));
    }
    let p = Policy::new(&config::from_str(&src, Path::new("p.toml")).unwrap());
    assert_eq!(p.rule_count(), 10_008);
    let v = decide(&p, "198.19.2.1", "h9999.example.com", 443, &["198.18.9.9"]);
    assert!(v.is_allow());
}

#[test]
fn dns_answers_names_reachable_on_some_port() {
    let p = policy();
    let c = ip(ACME);
    let v = p.decide_name_any_port(c, "api.example.com");
    assert_eq!(
        (v.reason, v.rule.as_deref()),
        (Reason::RuleMatch, Some("api"))
    );
    assert_eq!(
        p.decide_name_any_port(c, "uploads.example.org").reason,
        Reason::ExplicitDeny
    );
    assert_eq!(
        p.decide_name_any_port(c, "evil.com").reason,
        Reason::NoMatchingRule
    );
    assert_eq!(
        p.decide_name_any_port(ip("198.20.0.1"), "api.example.com")
            .reason,
        Reason::UnknownClient
    );
    // a deny on the only allowed port leaves nothing reachable
    let src = format!("{POLICY}[[org.deny]]\nhost = \"example.org\"\nports = [80, 443]\n");
    let p = Policy::new(&config::from_str(&src, Path::new("p.toml")).unwrap());
    assert_eq!(
        p.decide_name_any_port(ip("198.19.2.1"), "example.org")
            .reason,
        Reason::ExplicitDeny
    );
}

#[test]
fn dns_answers_are_filtered_without_a_port() {
    let p = policy();
    let org = p.org_for(ip(ACME)).unwrap();
    assert!(p.answer_allowed(&org, ip("198.18.9.9")).is_ok());
    assert_eq!(
        p.answer_allowed(&org, ip("127.0.0.1")).unwrap_err().reason,
        Reason::DeniedAddress
    );
    assert_eq!(
        p.answer_allowed(&org, ip("64:ff9b::a9fe:a9fe"))
            .unwrap_err()
            .reason,
        Reason::DeniedAddress
    );
    // covered by a cidr allow on some port
    assert!(p.answer_allowed(&org, ip("10.1.2.3")).is_ok());
    // deny cidr on every port
    assert_eq!(
        p.answer_allowed(&org, ip("198.18.7.66"))
            .unwrap_err()
            .reason,
        Reason::ExplicitDeny
    );
}

#[test]
fn report_mode_lets_the_allowlist_denials_through_and_says_so() {
    let src = POLICY.replace("name = \"acme\"\n", "name = \"acme\"\nmode = \"report\"\n");
    let p = Policy::new(&config::from_str(&src, Path::new("p.toml")).unwrap());
    // denied by name: resolved and allowed, with what enforcement would do
    let v = decide(&p, ACME, "evil.com", 443, &["198.18.9.9"]);
    assert_eq!(
        (v.reason, v.would_deny),
        (Reason::ReportOnly, Some(Reason::NoMatchingRule))
    );
    let v = decide(&p, ACME, "uploads.example.org", 443, &["198.18.9.9"]);
    assert_eq!(
        (v.reason, v.would_deny),
        (Reason::ReportOnly, Some(Reason::ExplicitDeny))
    );
    assert_eq!(v.rule.as_deref(), Some("acme/deny/0"));
    let v = decide(&p, ACME, "api.example.com", 80, &["198.18.9.9"]);
    assert_eq!(v.would_deny, Some(Reason::PortNotAllowed));
    // an address deny rule, for names and IPs
    let v = decide(&p, ACME, "a.example.org", 443, &["198.18.7.66"]);
    assert_eq!(
        (v.reason, v.would_deny),
        (Reason::ReportOnly, Some(Reason::ExplicitDeny))
    );
    let v = decide(&p, ACME, "198.18.8.5", 5432, &[]);
    assert_eq!(
        (v.reason, v.would_deny),
        (Reason::ReportOnly, Some(Reason::NoMatchingRule))
    );
    // safety denials are enforced in every mode
    assert_eq!(
        reason(&p, "evil.com", 443, &["169.254.169.254"]),
        Reason::DeniedAddress
    );
    assert_eq!(reason(&p, "127.0.0.1", 80, &[]), Reason::DeniedAddress);
    // allowed traffic is plain rule_match; other orgs enforce
    assert_eq!(
        reason(&p, "api.example.com", 443, &["198.18.9.9"]),
        Reason::RuleMatch
    );
    assert_eq!(
        decide(&p, "198.19.2.1", "evil.com", 443, &["198.18.9.9"]).reason,
        Reason::NoMatchingRule
    );
    // DNS
    let v = p.decide_name_any_port(ip(ACME), "evil.com");
    assert_eq!(
        (v.reason, v.would_deny),
        (Reason::ReportOnly, Some(Reason::NoMatchingRule))
    );
    // the mode is part of the policy's identity
    assert_ne!(p.hash(), policy().hash());
}

/// The identity table, row by row: two token orgs and an address org
/// behind one shared network, and a token org reachable from anywhere.
#[test]
fn identity_rows_i1_to_i6() {
    use crate::config::TokenDigest;
    let d = |t: &str| TokenDigest::of(t.as_bytes()).to_string();
    let src = format!(
        r#"
[[org]]
name = "shared"
clients = ["198.19.9.0/24"]

[[org]]
name = "red"
identity = "address+token"
clients = ["198.19.9.0/24"]
tokens = ["{}"]

[[org]]
name = "blue"
identity = "address+token"
clients = ["198.19.9.0/24"]
tokens = ["{}", "{}"]

[[org]]
name = "roam"
identity = "token"
tokens = ["{}"]
"#,
        d("red-token"),
        d("blue-old"),
        d("blue-token"),
        d("roam-token")
    );
    let c = config::from_str(&src, Path::new("t.toml")).unwrap();
    let p = Policy::new(&c);
    let nat = ip("198.19.9.7");
    let elsewhere = ip("198.18.77.1");
    let who = |client: IpAddr, user: &str, token: &str| {
        p.org_for_identity(
            client,
            Some(Credential {
                user: user.as_bytes(),
                token: token.as_bytes(),
            }),
        )
        .map(|o| o.map(|o| o.name.to_string()))
    };
    // I1: no credentials, address org; token orgs never by address alone.
    assert_eq!(
        p.org_for_identity(nat, None)
            .unwrap()
            .unwrap()
            .name
            .as_ref(),
        "shared"
    );
    assert_eq!(p.org_for(nat).unwrap().name.as_ref(), "shared");
    // I2: no credentials, no address org, a token org would accept.
    assert_eq!(
        p.org_for_identity(elsewhere, None),
        Err(IdentityError::Required)
    );
    // I4, I5: the token tells orgs behind one address apart.
    assert_eq!(who(nat, "red", "red-token"), Ok(Some("red".into())));
    assert_eq!(who(nat, "blue", "blue-token"), Ok(Some("blue".into())));
    assert_eq!(who(nat, "blue", "blue-old"), Ok(Some("blue".into())));
    assert_eq!(
        who(elsewhere, "roam", "roam-token"),
        Ok(Some("roam".into()))
    );
    // I6: wrong token, another org's token, no such org, address org,
    // address outside an address+token org: all the same reason.
    for (client, user, token) in [
        (nat, "red", "blue-token"),
        (nat, "red", "red-token "),
        (nat, "nobody", "red-token"),
        (nat, "shared", "anything"),
        (elsewhere, "red", "red-token"),
        (nat, "r\u{e9}d", "red-token"),
    ] {
        let got = who(client, user, token);
        assert!(
            matches!(got, Err(IdentityError::Failed(_))),
            "{user}/{token}: {got:?}"
        );
        assert_eq!(got.unwrap_err().reason(), Reason::AuthFailed);
    }
    // Without token orgs, an unknown address stays unknown_client (I3).
    assert_eq!(policy().org_for_identity(elsewhere, None), Ok(None));
}

#[test]
fn request_rules_of_an_intercepting_rule() {
    let src = r#"
[[org]]
name = "acme"
clients = ["198.19.1.0/24"]

[[org.allow]]
id = "pypi"
host = "pypi.example.org"
intercept = true
methods = ["GET", "HEAD"]
paths = ["/simple/", "/packages/*.whl"]
deny_paths = ["/simple/private*"]

[[org.allow]]
id = "plain"
host = "plain.example.org"
"#;
    let c = config::from_str(src, Path::new("p.toml")).unwrap();
    let p = Policy::new(&c);
    let org = p.org_for("198.19.1.5".parse().unwrap()).unwrap();
    fn facts<'a>(method: &'a str, path: &'a str) -> super::request::RequestFacts<'a> {
        super::request::RequestFacts {
            host: "pypi.example.org",
            method,
            path,
        }
    }
    let r = |rule: &str, m: &str, path: &str| {
        p.decide_request(&org, rule, facts(m, path), [])
            .verdict
            .reason
    };
    assert!(p.intercept_rules(&org, "pypi").is_some());
    assert!(p.intercept_rules(&org, "plain").is_none());
    assert_eq!(r("pypi", "GET", "/simple/requests/"), Reason::RuleMatch);
    assert_eq!(
        r("pypi", "HEAD", "/packages/a/b/x-1.0.whl"),
        Reason::RuleMatch
    );
    assert_eq!(
        r("pypi", "GET", "/packages/x-1.0.tar.gz"),
        Reason::PathNotAllowed
    );
    assert_eq!(r("pypi", "POST", "/simple/"), Reason::MethodNotAllowed);
    assert_eq!(
        r("pypi", "GET", "/simple/private/x"),
        Reason::PathNotAllowed
    );
    assert_eq!(r("pypi", "GET", "/"), Reason::PathNotAllowed);
    assert_eq!(r("plain", "GET", "/"), Reason::NoMatchingRule);
    let v = p.decide_request(&org, "pypi", facts("POST", "/simple/"), []);
    assert_eq!(v.verdict.rule.as_deref(), Some("pypi"));
    // The path is normalised before any rule sees it.
    assert_eq!(
        r("pypi", "GET", "/simple/%70rivate/x"),
        Reason::PathNotAllowed
    );
    assert_eq!(r("pypi", "GET", "/simple/..;/x"), Reason::PathNotAllowed);
}
