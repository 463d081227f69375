//! `[[org]]`: names, clients, identity and tokens, DNS options; rules and
//! credentials are validated in their own files.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use ipnet::IpNet;
use toml::Spanned;

use super::credentials::validate_credentials;
use super::rules::validate_rules;
use super::values::{cidr, one_of, one_of_text};
use super::volume::volume;
use crate::config::error::Errors;
use crate::config::model::{
    Baseline, DnsAnswers, DnsDenied, Identity, OnMiss, OrgConfig, OrgMode, TokenDigest,
    DNS_NEVER_TYPES,
};
use crate::config::raw::RawOrg;

/// Org names appear in metrics labels and evidence: keep them plain.
fn valid_org_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// `pools_set`: `[dns]` has a synthetic pool (either family), which an org
/// with `dns_answers = "synthetic"` needs.
pub(super) fn validate_orgs(
    raw: Vec<RawOrg>,
    pools_set: bool,
    baseline: Option<&Baseline>,
    errors: &mut Errors<'_>,
) -> Vec<OrgConfig> {
    let mut orgs = Vec::new();
    let mut names: HashSet<String> = HashSet::new();
    let mut client_nets: HashMap<IpNet, String> = HashMap::new();
    // The baseline's deny ids are taken: an org rule cannot pass for one.
    let mut rule_ids: HashSet<String> = baseline
        .iter()
        .flat_map(|b| b.deny.iter().map(|r| r.id.clone()))
        .collect();
    let mut token_orgs: Vec<(TokenDigest, String)> = Vec::new();

    for org in raw {
        let raw_volume = (org.max_bytes_up, org.max_bytes_down, org.volume_window);
        let volume = volume(raw_volume, None, errors);
        let org_name = org.name.get_ref().clone();
        check_org_name(&org.name, &mut names, errors);

        let identity_span = org.identity.as_ref().map_or(org.name.span(), |i| i.span());
        let identity = validate_identity(org.identity.as_ref(), errors);
        let tokens = validate_tokens(
            (&org_name, identity_span),
            identity,
            &org.tokens,
            &mut token_orgs,
            errors,
        );
        if identity == Identity::Token {
            if let Some(first) = org.clients.first() {
                errors.at(
                    first.span(),
                    "an org with identity = \"token\" takes no clients (use \"address+token\" to require both)",
                );
            }
        }
        let mut nets = Vec::new();
        for client in &org.clients {
            let Some(net) = cidr(client, errors) else {
                continue;
            };
            // Token orgs may share a network (a NAT, a shared pool): their
            // token tells them apart. Address orgs may not.
            if identity == Identity::Address {
                if let Some(other) = client_nets.get(&net) {
                    errors.at(
                        client.span(),
                        format!("client network {net} already belongs to org {other:?}"),
                    );
                    continue;
                }
                client_nets.insert(net, org_name.clone());
            }
            nets.push(net);
        }
        if org.clients.is_empty() && identity != Identity::Token {
            errors.at(org.name.span(), format!("org {org_name:?} has no clients"));
        }

        let allow = validate_rules(
            &org_name,
            "allow",
            org.allow,
            &mut rule_ids,
            baseline,
            errors,
        );
        let deny = validate_rules(&org_name, "deny", org.deny, &mut rule_ids, None, errors);
        let dns_denied = org.dns_denied.map_or_else(DnsDenied::default, |v| {
            one_of("dns_denied", &v, DNS_DENIED, errors)
        });
        let dns_types = validate_dns_types(&org.dns_types, errors);
        let dns_answers = org.dns_answers.map_or_else(DnsAnswers::default, |v| {
            dns_answers_of(&v, pools_set, errors)
        });
        let mode = org
            .mode
            .map_or_else(OrgMode::default, |v| one_of("mode", &v, MODES, errors));
        let on_miss = org
            .on_miss
            .map_or_else(OnMiss::default, |v| one_of("on_miss", &v, ON_MISS, errors));
        let credentials =
            validate_credentials(&org_name, org.credential, &allow, &mut rule_ids, errors);
        orgs.push(OrgConfig {
            name: org_name,
            clients: nets,
            allow,
            deny,
            dns_denied,
            dns_types,
            dns_answers,
            mode,
            on_miss,
            identity,
            tokens,
            credentials,
            volume,
        });
    }
    orgs
}

/// An org's name: valid, not the reserved `unknown`, not used twice.
fn check_org_name(name: &Spanned<String>, names: &mut HashSet<String>, errors: &mut Errors<'_>) {
    let org_name = name.get_ref();
    if !valid_org_name(org_name) {
        errors.at(
            name.span(),
            format!("invalid org name {org_name:?} (use 1-64 of a-z, 0-9, '-', '_')"),
        );
    } else if org_name == "unknown" {
        errors.at(
            name.span(),
            "org name \"unknown\" is reserved for clients that match no org",
        );
    } else if !names.insert(org_name.clone()) {
        errors.at(name.span(), format!("org {org_name:?} is defined twice"));
    }
}

/// `dns_denied`, `mode` and `on_miss`: the values each may take.
const DNS_DENIED: &[(&str, DnsDenied)] = &[
    ("refused", DnsDenied::Refused),
    ("nxdomain", DnsDenied::Nxdomain),
];
const MODES: &[(&str, OrgMode)] = &[("enforce", OrgMode::Enforce), ("report", OrgMode::Report)];
const ON_MISS: &[(&str, OnMiss)] = &[("deny", OnMiss::Deny), ("ask", OnMiss::Ask)];

/// `dns_answers`: `"resolved"`, or `"synthetic"` where a pool is set.
fn dns_answers_of(v: &Spanned<String>, pools_set: bool, errors: &mut Errors<'_>) -> DnsAnswers {
    let answers = one_of(
        "dns_answers",
        v,
        &[
            ("resolved", DnsAnswers::Resolved),
            ("synthetic", DnsAnswers::Synthetic),
        ],
        errors,
    );
    if answers == DnsAnswers::Synthetic && !pools_set {
        errors.at(
            v.span(),
            "dns_answers = \"synthetic\" needs [dns] synthetic_pool or synthetic_pool_v6",
        );
        return DnsAnswers::default();
    }
    answers
}

fn validate_identity(raw: Option<&Spanned<String>>, errors: &mut Errors<'_>) -> Identity {
    let Some(v) = raw else {
        return Identity::default();
    };
    let choices = [
        ("address", Identity::Address),
        ("token", Identity::Token),
        ("address+token", Identity::AddressToken),
    ];
    one_of_text("identity", (v.get_ref().trim(), v.span()), &choices, errors)
}

/// Token digests of one org: hashed form only, only where the identity
/// uses them, at least one where it needs them, none shared between orgs.
fn validate_tokens(
    (org, span): (&str, Range<usize>),
    identity: Identity,
    raw: &[Spanned<String>],
    seen: &mut Vec<(TokenDigest, String)>,
    errors: &mut Errors<'_>,
) -> Vec<TokenDigest> {
    let mut out = Vec::new();
    for t in raw {
        if !identity.needs_token() {
            errors.at(
                t.span(),
                format!("org {org:?} lists tokens but its identity is \"address\" (set identity = \"token\" or \"address+token\")"),
            );
            break;
        }
        // Never echo the value: it may be a plain token pasted by mistake.
        let Some(digest) = TokenDigest::parse(t.get_ref().trim()) else {
            errors.at(
                t.span(),
                "token must be stored hashed as \"sha256:<64 hex digits>\", never plain (`palisade token new` prints the line)",
            );
            continue;
        };
        if let Some((_, other)) = seen.iter().find(|(d, _)| *d == digest) {
            errors.at(
                t.span(),
                format!("token is already listed for org {other:?}"),
            );
            continue;
        }
        seen.push((digest.clone(), org.to_string()));
        out.push(digest);
    }
    if identity.needs_token() && raw.is_empty() {
        errors.at(
            span,
            format!(
                "org {org:?} has identity {:?} but no tokens",
                identity.as_str()
            ),
        );
    }
    out
}

/// Query type names an org enables, upper case, each known to hickory and
/// none of [`DNS_NEVER_TYPES`].
fn validate_dns_types(raw: &[Spanned<String>], errors: &mut Errors<'_>) -> Vec<String> {
    use hickory_server::proto::rr::RecordType;
    let mut out: Vec<String> = Vec::new();
    for t in raw {
        let text = t.get_ref().trim().to_ascii_uppercase();
        if DNS_NEVER_TYPES.contains(&text.as_str()) {
            errors.at(
                t.span(),
                format!("dns type {text:?} is never answered by the DNS shim"),
            );
            continue;
        }
        match text.parse::<RecordType>() {
            Ok(RecordType::Unknown(_)) | Err(_) => errors.at(
                t.span(),
                format!(
                    "unknown dns type {:?} (e.g. \"TXT\", \"MX\", \"SRV\")",
                    t.get_ref()
                ),
            ),
            Ok(rt) => {
                let name = rt.to_string();
                if !out.contains(&name) {
                    out.push(name);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::{assert_first_error, first_error, parse, BASE};
    use crate::config::*;

    #[test]
    fn same_client_network_in_two_orgs_is_rejected() {
        let src = format!("{BASE}[[org]]\nname = \"other\"\nclients = [\"198.19.1.0/24\"]\n");
        assert_first_error(&src, "t.toml:11:", "already belongs to org \"acme\"");
    }

    #[test]
    fn token_identity_validates() {
        let digest = TokenDigest::of(b"secret-token").to_string();
        let ok = format!(
            "{BASE}[[org]]\nname = \"t\"\nidentity = \"token\"\ntokens = [\"{digest}\"]\n             [[org]]\nname = \"at\"\nidentity = \"address+token\"\nclients = [\"198.19.1.0/24\"]\n             tokens = [\"{}\"]\n",
            TokenDigest::of(b"other").to_string().to_uppercase().replace("SHA256:", "sha256:")
        );
        let c = parse(&ok).unwrap();
        assert_eq!(c.orgs[1].identity, Identity::Token);
        assert_eq!(c.orgs[1].tokens[0], TokenDigest::of(b"secret-token"));
        assert_eq!(c.orgs[2].identity, Identity::AddressToken);
        // The digests never reach the policy text.
        let json = serde_json::to_string(&c.orgs).unwrap();
        assert!(
            !json.contains(&digest[7..]) && json.contains("address+token"),
            "{json}"
        );

        let cases = [
            ("identity = \"token\"\ntokens = [\"secret-token\"]\n", "never plain"),
            ("identity = \"token\"\n", "no tokens"),
            ("identity = \"cert\"\n", "invalid identity \"cert\""),
            (&*format!("tokens = [\"{digest}\"]\n"), "identity is \"address\""),
            (
                &*format!("identity = \"token\"\nclients = [\"198.18.0.0/24\"]\ntokens = [\"{digest}\"]\n"),
                "takes no clients",
            ),
        ];
        for (lines, want) in cases {
            let src = format!("{BASE}[[org]]\nname = \"t\"\n{lines}");
            let e = first_error(&src);
            assert!(e.contains(want), "{lines}: {e}");
            assert!(!e.contains("secret-token"), "{e}");
            assert!(e.starts_with("t.toml:1"), "{lines}: {e}");
        }
        let twice = format!(
            "{BASE}[[org]]\nname = \"t\"\nidentity = \"token\"\ntokens = [\"{digest}\"]\n             [[org]]\nname = \"u\"\nidentity = \"token\"\ntokens = [\"{digest}\"]\n"
        );
        assert!(first_error(&twice).contains("already listed for org \"t\""));
    }
}
