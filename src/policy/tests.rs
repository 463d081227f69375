//! The truth table of the module doc, row by row.

// Tests may do anything: the purity lints of `policy` stop here.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use super::*;
use crate::config;
use crate::config::Carry;
use crate::proto::target::{normalize_host, Host};
use sha2::{Digest, Sha256};
use std::net::IpAddr;
use std::path::Path;

const ACME_RULES: &str = r#"
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
"#;

/// `ACME`'s rules above, then the org `lab`, allowed `example.org`.
fn policy_toml() -> String {
    let lab = crate::testing::org_toml("lab", &["198.19.0.0/16"], &["example.org"]);
    format!("{ACME_RULES}\n{lab}")
}

fn policy() -> Policy {
    Policy::new(&config::from_str(&policy_toml(), Path::new("p.toml")).unwrap())
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
    let mut c = config::from_str(&policy_toml(), Path::new("p.toml")).unwrap();
    c.orgs[0].allow.push(config::RuleConfig {
        id: "x".into(),
        target: config::RuleTarget::Exact("198.18.9.9".into()),
        ports: config::PortSet::All,
        intercept: None,
        tunnel: None,
        names: Default::default(),
        volume: None,
        window: None,
    });
    let p2 = Policy::new(&c);
    assert_eq!(reason(&p, "198.18.9.9", 443, &[]), Reason::NoMatchingRule);
    assert_eq!(reason(&p2, "198.18.9.9", 443, &[]), Reason::NoMatchingRule);
}

#[test]
fn own_listeners_are_never_dialled() {
    let p = policy();
    let mut c = config::from_str(&policy_toml(), Path::new("p.toml")).unwrap();
    c.orgs[0].allow.push(config::RuleConfig {
        id: "all".into(),
        target: config::RuleTarget::Cidr("0.0.0.0/0".parse().unwrap()),
        ports: config::PortSet::All,
        intercept: None,
        tunnel: None,
        names: Default::default(),
        volume: None,
        window: None,
    });
    let p2 = Policy::new(&c);
    assert_eq!(reason(&p2, "198.18.0.1", 3128, &[]), Reason::DeniedAddress);
    // admin listens on 0.0.0.0:9711: any address on that port is Palisade itself
    assert_eq!(reason(&p2, "198.18.5.5", 9711, &[]), Reason::DeniedAddress);
    assert_eq!(reason(&p2, "198.18.5.5", 9712, &[]), Reason::RuleMatch);
    // A listener's specific address is always-denied on every port, and
    // 0.0.0.0/0 does not open it ...
    assert_eq!(reason(&p2, "198.18.0.1", 443, &[]), Reason::DeniedAddress);
    assert_eq!(
        reason(&p, "api.example.com", 443, &["198.18.0.1"]),
        Reason::DeniedAddress
    );
    // ... a rule naming it does, but never on the listener's own port.
    c.orgs[0].allow.push(config::RuleConfig {
        id: "self".into(),
        target: config::RuleTarget::Cidr("198.18.0.1/32".parse().unwrap()),
        ports: config::PortSet::All,
        intercept: None,
        tunnel: None,
        names: Default::default(),
        volume: None,
        window: None,
    });
    let p3 = Policy::new(&c);
    assert_eq!(reason(&p3, "198.18.0.1", 443, &[]), Reason::RuleMatch);
    assert_eq!(reason(&p3, "198.18.0.1", 3128, &[]), Reason::DeniedAddress);
}

#[test]
fn first_matching_allow_rule_in_file_order_decides() {
    let src = format!(
        "{}\n[[org.allow]]\nid = \"second\"\nhost = \"a.example.org\"\n",
        policy_toml()
    );
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
    let src = policy_toml().replace("ports = [5432]", "ports = [5433]");
    let c = Policy::new(&config::from_str(&src, Path::new("p.toml")).unwrap());
    assert_ne!(a.hash(), c.hash());
}

#[test]
fn lookup_cost_is_independent_of_rule_count() {
    // The work of a name lookup (hash probes and candidate rules, counted,
    // not timed) is the same with 10 and with 10,000 rules besides the policy above.
    let with_rules = |n: usize| {
        let mut src = policy_toml();
        for i in 0..n {
            src.push_str(&format!("[[org.allow]]\nhost = \"h{i}.example.com\"\n"));
            src.push_str(&format!("[[org.allow]]\nhost = \"*.w{i}.example.com\"\n"));
        }
        Policy::new(&config::from_str(&src, Path::new("p.toml")).unwrap())
    };
    let (small, large) = (with_rules(5), with_rules(5_000));
    assert_eq!(large.rule_count(), small.rule_count() + 9_990);
    let client = ip("198.19.2.1");
    for name in [
        "h3.example.com",
        "a.w3.example.com",
        "api.example.com",
        "nothing.example.net",
        "deep.a.b.c.w4.example.com",
    ] {
        let (s, l) = (
            small.name_lookup_work(client, name),
            large.name_lookup_work(client, name),
        );
        assert!(s > 0, "{name}: no work counted");
        assert_eq!(s, l, "{name}: work grew with the rule count");
    }
    let v = decide(
        &large,
        "198.19.2.1",
        "h4999.example.com",
        443,
        &["198.18.9.9"],
    );
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
    let src = format!(
        "{}[[org.deny]]\nhost = \"example.org\"\nports = [80, 443]\n",
        policy_toml()
    );
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
    let src = policy_toml().replace("name = \"acme\"\n", "name = \"acme\"\nmode = \"report\"\n");
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
fn policy_answers_what_a_rule_carries() {
    let src = "[[org]]\nname = \"acme\"\nclients = [\"198.19.1.0/24\"]\n\
               [[org.allow]]\nid = \"ssh\"\nhost = \"a.com\"\nports = [22]\ntunnel = \"opaque\"\n\
               [[org.allow]]\nid = \"web\"\nhost = \"b.com\"\nports = [80, 443, 8080]\n\
               [[org.allow]]\nid = \"forced\"\nhost = \"c.com\"\nports = [443, 8443]\ntunnel = \"http\"\n\
               [[org.allow]]\nid = \"net\"\ncidr = \"198.18.0.0/15\"\n";
    let policy = Policy::new(&config::from_str(src, Path::new("t.toml")).unwrap());
    let org = policy.org_for("198.19.1.2".parse().unwrap()).unwrap();
    let carry = |rule: &str, name: bool, port| policy.carry(&org, Some(rule), name, port);
    assert_eq!(carry("ssh", true, 22), Carry::Opaque);
    assert_eq!(carry("web", true, 443), Carry::Tls);
    assert_eq!(carry("web", true, 80), Carry::Http);
    assert_eq!(carry("web", true, 8080), Carry::TlsOrHttp);
    assert_eq!(carry("forced", true, 443), Carry::Http);
    assert_eq!(carry("net", false, 443), Carry::Opaque);
    // Report mode without an allow rule: the port decides.
    assert_eq!(policy.carry(&org, None, true, 443), Carry::Tls);
}

#[test]
fn credential_sources_are_in_the_policy_text_never_secrets() {
    let src = "[[org]]\nname = \"acme\"\nclients = [\"198.19.1.0/24\"]\n\
               [[org.allow]]\nhost = \"*.reg.test\"\nintercept = true\n\
               [[org.credential]]\nid = \"t\"\nhost = \"api.reg.test\"\nheader = \"Authorization\"\n\
               prefix = \"Bearer \"\nsecret_env = \"TOKEN\"\n";
    let c = config::from_str(src, Path::new("t.toml")).unwrap();
    // The secret's source is in the policy hash text, never a secret.
    assert!(Policy::canonical_text(&c.orgs).contains("TOKEN"));
}

#[test]
fn a_replaced_token_changes_the_policy_hash_its_order_does_not() {
    let (a, b, c) = (
        config::TokenDigest::of(b"a"),
        config::TokenDigest::of(b"b"),
        config::TokenDigest::of(b"c"),
    );
    let hash = |tokens: &[&config::TokenDigest]| {
        let list: Vec<String> = tokens.iter().map(|t| format!("\"{t}\"")).collect();
        let src = format!(
            "[[org]]\nname = \"acme\"\nidentity = \"token\"\ntokens = [{}]\n\
             [[org.allow]]\nhost = \"a.com\"\n",
            list.join(", ")
        );
        let c = config::from_str(&src, Path::new("t.toml")).unwrap();
        let text = Policy::canonical_text(&c.orgs);
        for t in tokens {
            let hex = t.to_string();
            assert!(!text.contains(&hex[7..]), "a token digest in {text}");
        }
        Policy::new(&c).hash().to_string()
    };
    assert_eq!(hash(&[&a, &b]), hash(&[&b, &a]));
    assert_ne!(hash(&[&a, &b]), hash(&[&a, &c]));
    assert_ne!(hash(&[&a, &b]), hash(&[&a]));
    // An org without tokens hashes as it did before tokens had a digest.
    let src = "[[org]]\nname = \"acme\"\nclients = [\"198.19.1.0/24\"]\n";
    let c = config::from_str(src, Path::new("t.toml")).unwrap();
    assert!(!Policy::canonical_text(&c.orgs).contains("tokens"));
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

/// Address rules for the always-denied table (row C): a broad rule on the
/// web ports, one private network, the other orgs' sandbox networks and
/// Palisade's own listener address.
fn addresses_toml() -> String {
    let acme = crate::testing::org_toml("acme", &["198.19.1.0/24"], &[]);
    format!("[proxy]\nlisten = [\"10.0.0.5:3128\"]\n[admin]\nlisten = \"0.0.0.0:9711\"\n{acme}{ACME_ADDRESS_RULES}")
}

/// `acme`'s address rules and the other orgs, for [`addresses_toml`].
const ACME_ADDRESS_RULES: &str = r#"
[[org.allow]]
id = "web-v4"
cidr = "0.0.0.0/0"
ports = [80, 443]

[[org.allow]]
id = "web-v6"
cidr = "::/0"
ports = [80, 443]

[[org.allow]]
id = "db"
cidr = "10.20.0.0/16"
ports = [5432]

[[org.allow]]
id = "api"
host = "api.example.com"
ports = [443, 5432]

[[org.allow]]
id = "cache"
cidr = "10.0.0.0/8"
ports = [6379]

[[org.allow]]
id = "sibling-db"
cidr = "10.9.1.0/24"
ports = [5432]

[[org.allow]]
id = "self"
cidr = "10.0.0.5/32"
ports = [8080]

[[org.allow]]
id = "partner"
cidr = "198.51.100.128/25"
ports = [443]

[[org.deny]]
cidr = "10.20.9.0/24"

#EXTRA#

[[org]]
name = "beta"
clients = ["10.9.0.0/16", "fd00:9::/64"]

[[org]]
name = "gamma"
identity = "address+token"
clients = ["198.51.100.0/24"]
tokens = ["sha256:0000000000000000000000000000000000000000000000000000000000000000"]
"#;

/// The policy above with `extra` lines added to acme.
fn addresses(extra: &str) -> Policy {
    let src = addresses_toml().replace("#EXTRA#", extra);
    Policy::new(&config::from_str(&src, Path::new("a.toml")).unwrap())
}

/// The deciding rule of an IP target, or the reason it was denied.
fn ip_verdict(p: &Policy, target: &str, port: u16) -> (Reason, Option<String>) {
    let v = decide(p, ACME, target, port, &[]);
    (v.reason, v.rule.map(|r| r.to_string()))
}

#[test]
fn row_c_broad_rules_open_no_always_denied_range() {
    let p = addresses("");
    for (target, port) in [
        ("169.254.169.254", 80),
        ("127.0.0.1", 80),
        ("10.1.2.3", 443),
        ("192.168.1.1", 443),
        ("172.16.0.1", 80),
        ("100.64.0.1", 80),
        ("0.0.0.0", 80),
        ("255.255.255.255", 80),
        // another org's sandbox networks, whatever its identity
        ("10.9.0.7", 80),
        ("198.51.100.7", 443),
        ("[fd00:9::7]", 80),
        // Palisade's own listener address, on any port
        ("10.0.0.5", 80),
        ("[fd00:ec2::254]", 80),
        ("[fe80::1]", 443),
        ("[::1]", 80),
        ("[::]", 80),
        ("[ff02::1]", 80),
    ] {
        assert_eq!(
            ip_verdict(&p, target, port).0,
            Reason::DeniedAddress,
            "{target}:{port}"
        );
        let addr = target.trim_matches(['[', ']']);
        assert_eq!(
            reason(&p, "api.example.com", 443, &[addr]),
            Reason::DeniedAddress,
            "api.example.com -> {addr}"
        );
    }
    // Everything else on the web ports is what the broad rules are for.
    assert_eq!(
        ip_verdict(&p, "8.8.8.8", 80),
        (Reason::RuleMatch, Some("web-v4".into()))
    );
    assert_eq!(
        ip_verdict(&p, "[2606:4700::1]", 443),
        (Reason::RuleMatch, Some("web-v6".into()))
    );
}

#[test]
fn row_c_a_rule_inside_the_range_opens_it() {
    let p = addresses("");
    assert_eq!(
        ip_verdict(&p, "10.20.1.1", 5432),
        (Reason::RuleMatch, Some("db".into()))
    );
    assert_eq!(ip_verdict(&p, "10.21.0.1", 5432).0, Reason::DeniedAddress);
    assert_eq!(ip_verdict(&p, "10.20.1.1", 80).0, Reason::DeniedAddress);
    // names resolving there: only what a rule inside opens, on its port
    assert_eq!(
        reason(&p, "api.example.com", 5432, &["10.20.1.1"]),
        Reason::RuleMatch
    );
    assert_eq!(
        reason(&p, "api.example.com", 5432, &["10.21.0.1"]),
        Reason::DeniedAddress
    );
    // 10.0.0.0/8 opens the private range, but not a sandbox network or
    // Palisade's listener lying inside it.
    assert_eq!(
        ip_verdict(&p, "10.21.0.1", 6379),
        (Reason::RuleMatch, Some("cache".into()))
    );
    assert_eq!(ip_verdict(&p, "10.9.0.7", 6379).0, Reason::DeniedAddress);
    assert_eq!(ip_verdict(&p, "10.0.0.5", 6379).0, Reason::DeniedAddress);
    // a rule inside the sandbox network names it
    assert_eq!(
        ip_verdict(&p, "10.9.1.7", 5432),
        (Reason::RuleMatch, Some("sibling-db".into()))
    );
    assert_eq!(ip_verdict(&p, "10.9.2.7", 5432).0, Reason::DeniedAddress);
    // the listener's own /32 opens it, except on the listener's port
    assert_eq!(
        ip_verdict(&p, "10.0.0.5", 8080),
        (Reason::RuleMatch, Some("self".into()))
    );
    assert_eq!(ip_verdict(&p, "10.0.0.5", 3128).0, Reason::DeniedAddress);
    let all_ports = addresses("[[org.allow]]\ncidr = \"10.0.0.5/32\"\nports = [22, 3128]\n");
    assert_eq!(ip_verdict(&all_ports, "10.0.0.5", 22).0, Reason::RuleMatch);
    assert_eq!(
        ip_verdict(&all_ports, "10.0.0.5", 3128).0,
        Reason::DeniedAddress
    );
    // a rule inside another org's address+token network names it
    assert_eq!(
        ip_verdict(&p, "198.51.100.130", 443),
        (Reason::RuleMatch, Some("partner".into()))
    );
    assert_eq!(ip_verdict(&p, "198.51.100.7", 443).0, Reason::DeniedAddress);
    // a cidr deny still wins inside an opened range
    assert_eq!(ip_verdict(&p, "10.20.9.1", 5432).0, Reason::ExplicitDeny);
}

#[test]
fn row_c_an_unspecified_listener_is_only_its_port() {
    let p = addresses("");
    // admin on 0.0.0.0:9711: every address on 9711, nothing else
    let with_port = addresses("[[org.allow]]\ncidr = \"8.8.8.0/24\"\nports = [9711, 9712]\n");
    assert_eq!(ip_verdict(&p, "8.8.8.8", 9711).0, Reason::DeniedAddress);
    assert_eq!(ip_verdict(&p, "8.8.8.8", 9712).0, Reason::PortNotAllowed);
    assert_eq!(
        ip_verdict(&with_port, "8.8.8.8", 9711).0,
        Reason::DeniedAddress
    );
    assert_eq!(ip_verdict(&with_port, "8.8.8.8", 9712).0, Reason::RuleMatch);
}

#[test]
fn row_c_new_special_ranges_are_denied() {
    let p = addresses("");
    for target in [
        "192.0.0.1",
        "192.0.0.170",
        "[::ffff:0:808:808]",
        "[64:ff9b:1::808:808]",
        "[100::1]",
        "[5f00::1]",
    ] {
        assert_eq!(
            ip_verdict(&p, target, 443).0,
            Reason::DeniedAddress,
            "{target}"
        );
    }
    // benchmarking and the IPv4 documentation ranges stay open (see
    // ALWAYS_DENIED); the IPv6 documentation ranges do not
    for target in ["198.18.0.9", "192.0.2.1", "203.0.113.9", "[2001:2::1]"] {
        assert_eq!(ip_verdict(&p, target, 443).0, Reason::RuleMatch, "{target}");
    }
    for target in [
        "[2001:db8::1]",
        "[2001:db8:ffff::1]",
        "[3fff::1]",
        "[3fff:fff::1]",
    ] {
        assert_eq!(
            ip_verdict(&p, target, 443).0,
            Reason::DeniedAddress,
            "{target}"
        );
    }
    assert_eq!(ip_verdict(&p, "[3fff:1000::1]", 443).0, Reason::RuleMatch);
    // a rule inside one opens it, as for every other range
    let doc = addresses("[[org.allow]]\nid = \"lab\"\ncidr = \"2001:db8:1::/48\"\nports = [80]\n");
    assert_eq!(
        ip_verdict(&doc, "[2001:db8:1::7]", 80),
        (Reason::RuleMatch, Some("lab".into()))
    );
    assert_eq!(
        ip_verdict(&doc, "[2001:db8:2::7]", 80).0,
        Reason::DeniedAddress
    );
}

#[test]
fn row_c_isatap_is_judged_by_its_embedded_ipv4() {
    let p = addresses("");
    for target in [
        "[2001:2::5efe:127.0.0.1]",
        "[2001:2::200:5efe:169.254.169.254]",
        "[2606:4700:1:2:0:5efe:192.168.1.1]",
        "[2606:4700::200:5efe:a9fe:a9fe]",
        // another org's sandbox behind an ISATAP suffix
        "[2606:4700::5efe:10.9.0.7]",
    ] {
        assert_eq!(
            ip_verdict(&p, target, 80).0,
            Reason::DeniedAddress,
            "{target}"
        );
        let addr = target.trim_matches(['[', ']']);
        assert_eq!(
            reason(&p, "api.example.com", 443, &[addr]),
            Reason::DeniedAddress,
            "api.example.com -> {addr}"
        );
        let org = p.org_for(ip(ACME)).unwrap();
        assert_eq!(
            p.answer_allowed(&org, ip(addr)).map_err(|v| v.reason),
            Err(Reason::DeniedAddress),
            "answer {addr}"
        );
    }
    // an ordinary IPv4 behind it is what ::/0 is for
    assert_eq!(
        ip_verdict(&p, "[2606:4700::5efe:8.8.8.8]", 80),
        (Reason::RuleMatch, Some("web-v6".into()))
    );
    // 6to4 of a public address with an ISATAP suffix of loopback: each
    // embedded address must pass
    assert_eq!(
        ip_verdict(&p, "[2002:808:808::5efe:127.0.0.1]", 80).0,
        Reason::DeniedAddress
    );
}

/// The [`addresses`] policy served on a host with `host` addresses.
fn on_host(host: &[&str], extra: &str) -> Policy {
    let src = addresses_toml().replace("#EXTRA#", extra);
    let host: Vec<IpAddr> = host.iter().map(|a| ip(a)).collect();
    Policy::with_host(&config::from_str(&src, Path::new("a.toml")).unwrap(), &host)
}

const GATEWAY: &[&str] = &[
    "198.18.2.1",
    "2001:2::1",
    "fe80::1",
    "127.0.0.1",
    "::1",
    "::ffff:198.18.9.9",
    "198.18.2.1",
];

#[test]
fn row_c_the_hosts_own_addresses_are_denied_unless_a_rule_names_them() {
    let extra = "[[org.allow]]\nid = \"gw-ssh\"\ncidr = \"198.18.2.1/32\"\nports = [22]\n\n\
                 [[org.allow]]\nid = \"lo\"\ncidr = \"127.0.0.0/8\"\nports = [8080]\n\n\
                 [[org.allow]]\nid = \"ll\"\ncidr = \"fe80::/10\"\nports = [80]\n";
    let p = on_host(GATEWAY, extra);
    // Without the host's addresses (replay, tests), the broad rules open them.
    let away = addresses(extra);
    assert_eq!(ip_verdict(&away, "198.18.2.1", 80).0, Reason::RuleMatch);
    assert!(away.host_addresses().is_empty());
    for (target, port) in [
        ("198.18.2.1", 80),
        ("198.18.2.1", 443),
        ("198.18.9.9", 80),
        ("[::ffff:198.18.9.9]", 80),
        ("[2001:2::1]", 443),
        ("[fe80::1]", 80),
        // embedded forms of a gateway address
        ("[64:ff9b::198.18.2.1]", 80),
        ("[2002:c612:201::1]", 80),
        ("[2606:4700::5efe:198.18.2.1]", 80),
    ] {
        assert_eq!(
            ip_verdict(&p, target, port).0,
            Reason::DeniedAddress,
            "{target}:{port}"
        );
        let addr = target.trim_matches(['[', ']']);
        assert_eq!(
            reason(&p, "api.example.com", 443, &[addr]),
            Reason::DeniedAddress,
            "api.example.com -> {addr}"
        );
    }
    // Neighbours are what the broad rules are for.
    for (target, rule) in [
        ("198.18.2.2", "web-v4"),
        ("[2001:2::2]", "web-v6"),
        ("[fe80::2]", "ll"),
    ] {
        assert_eq!(
            ip_verdict(&p, target, 80),
            (Reason::RuleMatch, Some(rule.into())),
            "{target}"
        );
    }
    // A rule naming the address opens it, on its ports only.
    assert_eq!(
        ip_verdict(&p, "198.18.2.1", 22),
        (Reason::RuleMatch, Some("gw-ssh".into()))
    );
    // Loopback stays a fixed range: a rule inside 127.0.0.0/8 opens the
    // host's 127.0.0.1 as it did.
    assert_eq!(
        ip_verdict(&p, "127.0.0.1", 8080),
        (Reason::RuleMatch, Some("lo".into()))
    );
    // DNS answers: stripped unless opened on some port.
    let org = p.org_for(ip(ACME)).unwrap();
    let answer = |a: &str| p.answer_allowed(&org, ip(a)).map_err(|v| v.reason);
    assert_eq!(answer("2001:2::1"), Err(Reason::DeniedAddress));
    assert_eq!(answer("198.18.9.9"), Err(Reason::DeniedAddress));
    assert_eq!(answer("198.18.2.1"), Ok(()));
    // What a reload compares: canonical, sorted, unique.
    let listed: Vec<String> = p.host_addresses().iter().map(|a| a.to_string()).collect();
    assert_eq!(
        listed,
        [
            "127.0.0.1",
            "198.18.2.1",
            "198.18.9.9",
            "::1",
            "2001:2::1",
            "fe80::1"
        ]
    );
    // The hash is the orgs' alone: the same policy text on another host.
    assert_eq!(p.hash(), away.hash());
}

#[test]
fn openings_list_rules_that_name_a_gateway_address() {
    let extra = "[[org.allow]]\nid = \"gw-ssh\"\ncidr = \"198.18.2.1/32\"\nports = [22]\n\n\
                 [[org.allow]]\nid = \"gw-v6\"\ncidr = \"2001:2::1/128\"\nports = [80]\n\n\
                 [[org.allow]]\nid = \"bench\"\ncidr = \"198.18.0.0/15\"\nports = [8080]\n";
    let p = on_host(GATEWAY, extra);
    let got: Vec<String> = p
        .openings()
        .iter()
        .filter(|o| {
            o.what
                .iter()
                .any(|w| &**w == crate::policy::GATEWAY_ADDRESS)
        })
        .map(|o| format!("{} {} {}", o.rule, o.net, o.range))
        .collect();
    // The broad rules and the benchmarking /15 contain gateway addresses
    // but open none.
    assert_eq!(
        got,
        [
            "gw-ssh 198.18.2.1/32 198.18.2.1/32",
            "gw-v6 2001:2::1/128 2001:2::1/128"
        ]
    );
}

#[test]
fn row_c_embedded_ipv4_needs_its_own_opening() {
    let p = addresses("");
    // the IPv6 address is open by ::/0; the embedded IPv4 decides
    assert_eq!(
        ip_verdict(&p, "[64:ff9b::808:808]", 80),
        (Reason::RuleMatch, Some("web-v6".into()))
    );
    for target in [
        "[64:ff9b::127.0.0.1]",
        "[64:ff9b::a9fe:a9fe]",
        "[64:ff9b::10.20.1.1]",
        "[::ffff:0:127.0.0.1]",
        "[::127.0.0.1]",
        "[2002:7f00:1::1]",
        // Teredo, client 127.0.0.1 (XOR 0xffffffff)
        "[2001:0:4136:e378:8000:63bf:80ff:fffe]",
    ] {
        assert_eq!(
            ip_verdict(&p, target, 80).0,
            Reason::DeniedAddress,
            "{target}"
        );
    }
    // a v6 rule over the NAT64 prefix does not open the IPv4 behind it ...
    let nat64 = addresses("[[org.allow]]\ncidr = \"64:ff9b::/96\"\nports = [80]\n");
    assert_eq!(
        ip_verdict(&nat64, "[64:ff9b::127.0.0.1]", 80).0,
        Reason::DeniedAddress
    );
    // ... an IPv4 rule inside the IPv4 range does, for the IPv4 side; the
    // v6 address still needs its own rule (row 8).
    let lo = "[[org.allow]]\ncidr = \"127.0.0.1/32\"\nports = [80]\n";
    let p = addresses(lo);
    assert_eq!(
        ip_verdict(&p, "[64:ff9b::127.0.0.1]", 80),
        (Reason::RuleMatch, Some("web-v6".into()))
    );
    assert_eq!(
        ip_verdict(&p, "[64:ff9b::127.0.0.2]", 80).0,
        Reason::DeniedAddress
    );
    // the local-use NAT64 prefix: a rule inside it opens the v6 side, the
    // embedded address is checked all the same
    let local = addresses("[[org.allow]]\ncidr = \"64:ff9b:1::/96\"\nports = [80]\n");
    assert_eq!(
        ip_verdict(&local, "[64:ff9b:1::8.8.8.8]", 80).0,
        Reason::RuleMatch
    );
    assert_eq!(
        ip_verdict(&local, "[64:ff9b:1::127.0.0.1]", 80).0,
        Reason::DeniedAddress
    );
    assert_eq!(
        ip_verdict(&local, "[64:ff9b:1:1::8.8.8.8]", 80).0,
        Reason::DeniedAddress
    );
    // SIIT, opened on the v6 side only
    let siit = addresses("[[org.allow]]\ncidr = \"::ffff:0:0:0/96\"\nports = [80]\n");
    assert_eq!(
        ip_verdict(&siit, "[::ffff:0:8.8.8.8]", 80).0,
        Reason::RuleMatch
    );
    assert_eq!(
        ip_verdict(&siit, "[::ffff:0:10.1.2.3]", 80).0,
        Reason::DeniedAddress
    );
}

#[test]
fn row_c_dns_answers_are_stripped_unless_opened() {
    let p = addresses("");
    let org = p.org_for(ip(ACME)).unwrap();
    let stripped = |a: &str| p.answer_allowed(&org, ip(a)).map_err(|v| v.reason);
    for a in [
        "169.254.169.254",
        "127.0.0.1",
        "192.168.1.1",
        "10.9.0.7",
        "198.51.100.7",
        "192.0.0.8",
        "fd00:ec2::254",
        "fd00:9::7",
        "64:ff9b::7f00:1",
        "64:ff9b:1::808:808",
        "::ffff:0:808:808",
    ] {
        assert_eq!(stripped(a), Err(Reason::DeniedAddress), "{a}");
    }
    for a in [
        "8.8.8.8",
        "2606:4700::1",
        "64:ff9b::808:808",
        // opened by a rule inside on some port
        "10.20.1.1",
        "10.21.0.1",
        "10.9.1.7",
        "10.0.0.5",
    ] {
        assert_eq!(stripped(a), Ok(()), "{a}");
    }
}

#[test]
fn openings_list_each_rule_inside_an_always_denied_range() {
    let p = addresses("");
    let got: Vec<String> = p
        .openings()
        .iter()
        .map(|o| {
            let what: Vec<&str> = o.what.iter().map(|w| &**w).collect();
            format!("{} {} {} {}", o.rule, o.net, o.range, what.join("+"))
        })
        .collect();
    assert_eq!(
        got,
        [
            "db 10.20.0.0/16 10.0.0.0/8 private",
            "cache 10.0.0.0/8 10.0.0.0/8 private",
            "sibling-db 10.9.1.0/24 10.9.0.0/16 clients of beta",
            "sibling-db 10.9.1.0/24 10.0.0.0/8 private",
            "self 10.0.0.5/32 10.0.0.5/32 Palisade listener",
            "self 10.0.0.5/32 10.0.0.0/8 private",
            "partner 198.51.100.128/25 198.51.100.0/24 clients of gamma",
        ]
    );
    // a network two orgs share (address+token) names both
    let src = format!(
        "{}[[org]]\nname = \"delta\"\nidentity = \"address+token\"\n\
         clients = [\"198.51.100.0/24\"]\ntokens = [\"sha256:{}\"]\n",
        addresses_toml().replace("#EXTRA#", ""),
        "1".repeat(64)
    );
    let shared = Policy::new(&config::from_str(&src, Path::new("a.toml")).unwrap());
    let o = shared
        .openings()
        .into_iter()
        .find(|o| &*o.rule == "partner")
        .unwrap();
    let what: Vec<&str> = o.what.iter().map(|w| &**w).collect();
    assert_eq!(what, ["clients of gamma", "clients of delta"]);
}

#[test]
fn long_labels_under_a_wildcard_are_denied_name_budget_exceeded() {
    let src = r#"
[proxy]
listen = ["198.18.0.1:3128"]
[[org]]
name = "acme"
clients = ["198.19.1.0/24"]
[[org.allow]]
id = "short"
host = "*.short.test"
max_label_length = 8
max_new_names_per_minute = 5
[[org.allow]]
id = "free"
host = "*.free.test"
max_new_names_per_minute = 0
[[org.allow]]
id = "exact"
host = "averyveryverylonglabel.short.test"
[[org]]
name = "watch"
mode = "report"
clients = ["198.19.2.0/24"]
[[org.allow]]
host = "*.short.test"
max_label_length = 8
"#;
    let p = Policy::new(&config::from_str(src, Path::new("p.toml")).unwrap());
    let name = |client: &str, n: &str| {
        let v = decide(&p, client, n, 443, &["198.18.2.1"]);
        (
            v.reason,
            v.rule.as_deref().map(str::to_string),
            v.would_deny,
        )
    };
    let r = |s: &str| Some(s.to_string());
    assert_eq!(
        name(ACME, "abcdefgh.x.short.test"),
        (Reason::RuleMatch, r("short"), None)
    );
    // Labels of the suffix itself do not count ("short" is the rule's).
    assert_eq!(
        name(ACME, "abcdefghi.short.test"),
        (Reason::NameBudgetExceeded, r("short"), None)
    );
    assert_eq!(
        name(ACME, "a.abcdefghi.short.test"),
        (Reason::NameBudgetExceeded, r("short"), None)
    );
    // An exact rule for the name is not bound by the wildcard's limit.
    assert_eq!(
        name(ACME, "averyveryverylonglabel.short.test"),
        (Reason::RuleMatch, r("exact"), None)
    );
    // The DNS question: the same.
    let any = |n: &str| p.decide_name_any_port(ip(ACME), n).reason;
    assert_eq!(any("abcdefghi.short.test"), Reason::NameBudgetExceeded);
    assert_eq!(any("abcdefgh.short.test"), Reason::RuleMatch);
    // Report mode lets it through, saying so.
    assert_eq!(
        name("198.19.2.9", "abcdefghi.short.test"),
        (
            Reason::ReportOnly,
            Some("watch/allow/0".to_string()),
            Some(Reason::NameBudgetExceeded)
        )
    );
    // The budget the edges spend from: wildcard rules only, 0 unlimited.
    let acme = p.org_for(ip(ACME)).unwrap();
    assert_eq!(p.name_budget(&acme, "short"), Some(5));
    assert_eq!(p.name_budget(&acme, "free"), None);
    assert_eq!(p.name_budget(&acme, "exact"), None);
    let watch = p.org_for(ip("198.19.2.9")).unwrap();
    assert_eq!(p.name_budget(&watch, "watch/allow/0"), Some(60));
}

/// The synthetic pools are never dialled: an address in one is denied
/// (an IP target, or what a name resolves to), and `check` names it.
#[test]
fn synthetic_pools_are_always_denied() {
    let pools =
        "[dns]\nsynthetic_pool = \"198.18.200.0/24\"\nsynthetic_pool_v6 = \"2001:2:0:200::/120\"\n";
    let src = format!("{pools}{}", policy_toml());
    let p = Policy::new(&config::from_str(&src, Path::new("p.toml")).unwrap());
    for (target, addrs) in [
        ("198.18.200.7", &[][..]),
        ("2001:2:0:200::7", &[][..]),
        ("api.example.com", &["198.18.200.7"][..]),
    ] {
        assert_eq!(
            decide(&p, ACME, target, 443, addrs).reason,
            Reason::DeniedAddress,
            "{target}"
        );
    }
    // Beside the pool, as before.
    assert_eq!(
        decide(&p, ACME, "api.example.com", 443, &["198.18.201.7"]).reason,
        Reason::RuleMatch
    );
}

/// The baseline's denials, decided before any org rule: [`policy_toml`] plus a
/// report-mode org, under a baseline denying names and addresses its orgs
/// allow.
mod baseline {
    use super::*;

    const BASELINE: &str = r#"
[[deny]]
id = "api"
host = "api.example.com"

[[deny]]
host = "*.x.example.org"
ports = [443]

[[deny]]
id = "db"
cidr = "198.18.7.0/28"
ports = [5432]

[[deny]]
id = "all-ports"
cidr = "198.18.8.0/24"
"#;

    fn policy() -> (tempfile::TempDir, Policy) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("b.toml"), BASELINE).unwrap();
        let src = format!(
            "[policy]\nbaseline = \"b.toml\"\n{}\n[[org]]\nname = \"rep\"\nclients = [\"198.20.0.0/16\"]\nmode = \"report\"\n\
             [[org.allow]]\nhost = \"api.example.com\"\n[[org.allow]]\ncidr = \"198.18.8.0/24\"\n",
            policy_toml()
        );
        let config = config::from_str(&src, &dir.path().join("p.toml")).unwrap();
        (dir, Policy::new(&config))
    }

    fn fin(d: Decision) -> Verdict {
        match d {
            Decision::Final(v) => v,
            other => panic!("not final: {other:?}"),
        }
    }

    fn name(s: &str) -> Host {
        normalize_host(s).unwrap()
    }

    #[test]
    fn a_baseline_deny_wins_over_every_orgs_allow_whatever_its_mode() {
        let (_dir, p) = policy();
        // (client, target, port, rule that decides, layer)
        for client in [ACME, "198.20.0.1"] {
            let v = fin(p.decide(ip(client), &name("api.example.com"), 443));
            assert_eq!(
                (v.reason, v.rule.as_deref(), v.would_deny),
                (Reason::ExplicitDeny, Some("baseline:api"), None),
                "{client}"
            );
            assert_eq!(p.layer_of(&v), Some(Layer::Baseline));
            let v = fin(p.decide(ip(client), &Host::Ip(ip("198.18.8.9")), 22));
            assert_eq!(v.rule.as_deref(), Some("baseline:all-ports"), "{client}");
        }
        // The org's own explicit deny is the org's layer.
        let v = fin(p.decide(ip(ACME), &name("uploads.example.org"), 443));
        assert_eq!(
            (v.reason, p.layer_of(&v)),
            (Reason::ExplicitDeny, Some(Layer::Org))
        );
    }

    #[test]
    fn baseline_ports_and_wildcards_bound_what_it_denies() {
        let (_dir, p) = policy();
        // *.x.example.org on 443 only; the org allows *.example.org on 80, 443.
        let v = fin(p.decide(ip(ACME), &name("a.x.example.org"), 443));
        assert_eq!(v.rule.as_deref(), Some("baseline:deny/1"));
        let Decision::Resolve(pending) = p.decide(ip(ACME), &name("a.x.example.org"), 80) else {
            panic!("port 80 is the org's to decide");
        };
        assert_eq!(
            p.layer_of(&p.check_addresses(&pending, &[ip("198.18.3.3")]).verdict),
            Some(Layer::Org)
        );
        // x.example.org itself is not below the wildcard.
        assert!(matches!(
            p.decide(ip(ACME), &name("x.example.org"), 443),
            Decision::Resolve(_)
        ));
        // A cidr deny on 5432 inside the org's cidr allow, directly, through
        // an embedded IPv4 address (NAT64) and as a resolved address.
        for target in ["198.18.7.5", "64:ff9b::198.18.7.5"] {
            let v = fin(p.decide(ip(ACME), &Host::Ip(ip(target)), 5432));
            assert_eq!(v.rule.as_deref(), Some("baseline:db"), "{target}");
        }
        let v = fin(p.decide(ip(ACME), &Host::Ip(ip("198.18.7.20")), 5432));
        assert_eq!(
            (v.reason, p.layer_of(&v)),
            (Reason::RuleMatch, Some(Layer::Org))
        );
        let Decision::Resolve(pending) = p.decide(ip(ACME), &name("a.example.org"), 443) else {
            panic!("allowed by name");
        };
        let av = p.check_addresses(&pending, &[ip("198.18.8.1"), ip("198.18.3.3")]);
        assert_eq!(av.dial, [ip("198.18.3.3")]);
        let av = p.check_addresses(&pending, &[ip("198.18.8.1")]);
        assert_eq!(av.verdict.rule.as_deref(), Some("baseline:all-ports"));
    }

    #[test]
    fn the_dns_shim_refuses_what_the_baseline_denies_on_every_port() {
        let (_dir, p) = policy();
        let v = p.decide_name_any_port(ip(ACME), "api.example.com");
        assert_eq!(
            (v.reason, v.rule.as_deref()),
            (Reason::ExplicitDeny, Some("baseline:api"))
        );
        let v = p.decide_name_any_port(ip("198.20.0.1"), "api.example.com");
        assert_eq!(
            (v.reason, v.would_deny),
            (Reason::ExplicitDeny, None),
            "report mode"
        );
        assert!(!p.binds("rep", "api.example.com"));
        // 443 is denied, 80 is still open: the name is answered.
        assert!(p
            .decide_name_any_port(ip(ACME), "a.x.example.org")
            .is_allow());
        let org = p.org_for(ip(ACME)).unwrap();
        let v = p.answer_allowed(&org, ip("198.18.8.7")).unwrap_err();
        assert_eq!(v.rule.as_deref(), Some("baseline:all-ports"));
        // A port-bound cidr deny strips nothing from answers.
        assert!(p.answer_allowed(&org, ip("198.18.7.5")).is_ok());
    }

    #[test]
    fn the_baseline_hash_is_the_files() {
        let (_dir, p) = policy();
        let want = data_encoding::HEXLOWER.encode(&Sha256::digest(BASELINE.as_bytes()));
        assert_eq!(p.baseline_hash().map(|h| h.to_string()), Some(want));
        assert_eq!(super::policy().baseline_hash(), None);
    }
}

/// A time-bound rule matches from `not_before` (inclusive) until `expires`
/// (exclusive), at the instant the policy decides at; for names, the DNS
/// question, addresses and the always-denied ranges it opens alike.
#[test]
fn a_time_bound_rule_matches_only_inside_its_interval() {
    const TIMED: &str = r#"
[proxy]
listen = ["198.18.0.1:3128"]

[[org]]
name = "acme"
clients = ["198.19.1.0/24"]

[[org.allow]]
id = "late"
host = "late.example.com"
not_before = "2026-12-05T08:00:00Z"

[[org.allow]]
id = "short"
host = "short.example.com"
not_before = "2026-12-05T08:00:00+01:00"
expires = "2026-12-05T09:00:00Z"

[[org.allow]]
id = "db"
cidr = "10.9.8.0/24"
ports = [5432]
expires = "2026-12-05T09:00:00Z"
"#;
    let config = config::from_str(TIMED, Path::new("p.toml")).unwrap();
    let t = |s: &str| config::parse_rfc3339(s).unwrap();
    let ns = std::time::Duration::from_nanos(1);
    let (start, end) = (t("2026-12-05T07:00:00Z"), t("2026-12-05T09:00:00Z"));
    let client = ip("198.19.1.5");
    let decide = |now: std::time::SystemTime, host: &str, port: u16| {
        let p = Policy::new(&config).at(now);
        let host = normalize_host(host).unwrap();
        let reason = match p.decide(client, &host, port) {
            Decision::Final(v) => v.reason,
            Decision::Resolve(pending) => match &host {
                Host::Name(_) => {
                    p.check_addresses(&pending, &[ip("198.18.9.9")])
                        .verdict
                        .reason
                }
                Host::Ip(_) => unreachable!(),
            },
        };
        let dns = p
            .decide_name_any_port(client, host.to_string().as_str())
            .reason;
        (reason, dns)
    };
    let allowed = (Reason::RuleMatch, Reason::RuleMatch);
    let missed = (Reason::NoMatchingRule, Reason::NoMatchingRule);
    for (now, short, late) in [
        (start - ns, missed, missed),
        (start, allowed, missed),
        (t("2026-12-05T08:00:00Z"), allowed, allowed),
        (end - ns, allowed, allowed),
        (end, missed, allowed),
        (end + ns, missed, allowed),
    ] {
        assert_eq!(decide(now, "short.example.com", 443), short, "{now:?}");
        assert_eq!(decide(now, "late.example.com", 80), late, "{now:?}");
    }
    // The cidr rule opens its always-denied range only until it expires.
    assert_eq!(decide(end - ns, "10.9.8.7", 5432).0, Reason::RuleMatch);
    assert_eq!(decide(end, "10.9.8.7", 5432).0, Reason::DeniedAddress);
    // Without an instant a time-bound rule never matches (fail closed).
    let timeless = Policy::new(&config);
    let short = normalize_host("short.example.com").unwrap();
    assert!(matches!(
        timeless.decide(client, &short, 443),
        Decision::Final(v) if v.reason == Reason::NoMatchingRule
    ));
    // The changes to come, and what explain names beside the denial.
    let p = Policy::new(&config).at(start - ns);
    assert_eq!(p.next_change(), Some(start));
    assert_eq!(
        Policy::new(&config).at(start).next_change(),
        Some(t("2026-12-05T08:00:00Z"))
    );
    assert_eq!(Policy::new(&config).at(end).next_change(), None);
    let org = p.org_for(client).unwrap();
    let dormant = p.dormant(&org, &short, 443);
    assert_eq!(dormant.len(), 1);
    assert_eq!(&*dormant[0].0, "short");
}
