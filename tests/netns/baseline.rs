//! The operator's baseline (`[policy] baseline = "FILE"`): `palisade
//! check` holds org allow rules to its `[[ceiling]]` and locates the
//! escape; live, its `[[deny]]` wins over an org's allow for proxy and DNS,
//! with `layer = "baseline"` and the file's hash in the record; a reload
//! with a broken or missing baseline keeps the old policy, and a change of
//! only the baseline file is picked up.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::find_path_line_col;
use crate::lab::{self, run_with_timeout, scratch_dir, CmdOutput, Lab, DEFAULT_POLICY};

const SECS10: Duration = Duration::from_secs(10);

fn palisade(args: &[&str]) -> CmdOutput {
    run_with_timeout(
        Command::new(lab::palisade_bin()).args(args),
        None,
        lab::CMD_TIMEOUT,
    )
}

fn sha256_hex(path: &Path) -> String {
    Sha256::digest(fs::read(path).unwrap())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A config naming `baseline`, with `orgs` as its org tables.
fn write_config(dir: &Path, baseline: &Path, orgs: &str) -> PathBuf {
    fs::create_dir_all(dir).unwrap();
    let cfg = format!(
        "[proxy]\nlisten = [\"198.18.1.1:3128\"]\n\n[admin]\nlisten = \"198.18.1.1:9711\"\n\n\
         [evidence]\ndir = {:?}\n\n[policy]\nbaseline = {:?}\n{orgs}",
        dir.join("evidence").display().to_string(),
        baseline.display().to_string(),
    );
    let path = dir.join("palisade.toml");
    fs::write(&path, cfg).unwrap();
    path
}

const CEILING: &str = r#"
[[ceiling]]
id = "partner-apis"
host = "*.partner.test"
ports = [443]

[[ceiling]]
id = "git"
host = "git.partner.test"
ports = [22, 443]
intercept = true

[[ceiling]]
id = "lab"
cidr = "198.18.0.0/15"
"#;

const ORG: &str = "\n[[org]]\nname = \"acme\"\nclients = [\"198.19.1.0/24\"]\n";

#[test]
fn check_holds_org_rules_to_the_ceiling_and_locates_the_escape() {
    let dir = scratch_dir("baseline-check");
    let baseline = dir.join("baseline.toml");
    fs::write(&baseline, CEILING).unwrap();

    // Inside: a name under the wildcard on its port, an intercepting rule
    // inside the entry that allows interception, a cidr inside the lab range.
    let inside = format!(
        "{ORG}[[org.allow]]\nhost = \"api.partner.test\"\nports = [443]\n\
         [[org.allow]]\nhost = \"git.partner.test\"\nports = [22]\nintercept = true\n\
         [[org.allow]]\ncidr = \"198.18.7.0/24\"\nports = [5432]\n"
    );
    let good = write_config(&dir.join("good"), &baseline, &inside);
    let out = palisade(&["check", "-c", good.to_str().unwrap()]);
    assert_eq!(
        out.code(),
        Some(0),
        "rules inside refused:\n{}",
        out.describe()
    );
    let summary = format!(
        "  baseline: {} (sha256 {}): 0 deny, 3 ceiling entries, every allow rule inside",
        baseline.display(),
        sha256_hex(&baseline)
    );
    assert!(out.stdout.contains(&summary), "{}", out.stdout);

    // Each escape: the rule's line, the entry escaped, and why.
    let cases = [
        (
            "host = \"evil.test\"\nports = [443]",
            "\"baseline:partner-apis\"",
            "its target is not inside it",
        ),
        (
            "host = \"api.partner.test\"",
            "\"baseline:partner-apis\"",
            "port 80 is not among its ports",
        ),
        (
            "host = \"api.partner.test\"\nports = [443]\nintercept = true",
            "\"baseline:partner-apis\"",
            "it intercepts and the ceiling has no intercept = true",
        ),
        (
            "cidr = \"198.16.0.0/12\"\nports = [443]",
            "\"baseline:lab\"",
            "its target is not inside it",
        ),
        (
            "host = \"*.partner.test.evil\"\nports = [443]",
            "\"baseline:partner-apis\"",
            "its target is not inside it",
        ),
    ];
    for (n, (rule, entry, why)) in cases.iter().enumerate() {
        // Line of `[[org.allow]]`: the config's lines before it plus ORG's.
        let orgs = format!("{ORG}[[org.allow]]\n{rule}\n");
        let cfg = write_config(&dir.join(format!("bad{n}")), &baseline, &orgs);
        let text = fs::read_to_string(&cfg).unwrap();
        let want_line = text.lines().position(|l| l == "[[org.allow]]").unwrap() + 1;
        let cfg_s = cfg.to_str().unwrap();
        let out = palisade(&["check", "-c", cfg_s]);
        assert_eq!(out.code(), Some(1), "{rule}: accepted:\n{}", out.describe());
        let all = format!("{}{}", out.stdout, out.stderr);
        let line = find_path_line_col(&all, cfg_s)
            .unwrap_or_else(|| panic!("{rule}: no `{cfg_s}:LINE:COL:` in:\n{all}"));
        assert!(
            line as usize >= want_line && line as usize <= want_line + 1,
            "{rule}: line {line}, want {want_line}:\n{all}"
        );
        assert!(all.contains("escapes the baseline's ceiling"), "{all}");
        assert!(
            all.contains(entry),
            "{rule}: entry {entry} not named:\n{all}"
        );
        assert!(all.contains(why), "{rule}: {why:?} not said:\n{all}");
        assert!(all.contains(&baseline.display().to_string()), "{all}");
    }

    // The baseline's own errors are located in the baseline file.
    let broken = dir.join("broken.toml");
    fs::write(&broken, "[[deny]]\nhost = \"a.test\"\nport = [22]\n").unwrap();
    let cfg = write_config(&dir.join("broken"), &broken, ORG);
    let out = palisade(&["check", "-c", cfg.to_str().unwrap()]);
    assert_eq!(out.code(), Some(1), "{}", out.describe());
    let all = format!("{}{}", out.stdout, out.stderr);
    let broken_s = broken.to_str().unwrap();
    assert_eq!(
        find_path_line_col(&all, broken_s),
        Some(3),
        "unknown key not located in the baseline:\n{all}"
    );
    assert!(all.contains("port"), "{all}");

    // A missing baseline refuses check and start-up: no fallback to none.
    let missing = dir.join("missing.toml");
    let cfg = write_config(&dir.join("missing"), &missing, ORG);
    let cfg_s = cfg.to_str().unwrap();
    for cmd in ["check", "run"] {
        let out = palisade(&[cmd, "-c", cfg_s]);
        assert_ne!(out.code(), Some(0), "{cmd}: {}", out.describe());
        let all = format!("{}{}", out.stdout, out.stderr);
        assert!(
            all.contains("cannot read baseline") && find_path_line_col(&all, cfg_s).is_some(),
            "{cmd}: {all}"
        );
    }
    let _ = fs::remove_dir_all(&dir);
}

/// The baseline of the live tests: it denies a name and an address that
/// `DEFAULT_POLICY` allows (`*.wild.test`, `198.18.2.30/32` on 80).
const DENY: &str = r#"
[[deny]]
id = "no-evil"
host = "evil.wild.test"

[[deny]]
id = "no-30"
cidr = "198.18.2.30/32"
ports = [80]
"#;

fn lab_with_baseline(baseline: &Path) -> Lab {
    let policy = format!(
        "\n[policy]\nbaseline = {:?}\n{DEFAULT_POLICY}",
        baseline.display().to_string()
    );
    Lab::builder()
        .policy(&policy)
        .dns_listen(&["198.18.1.1:53"])
        .start()
}

#[test]
fn the_baseline_denies_what_an_org_allows_and_records_its_layer() {
    let dir = scratch_dir("baseline-live");
    let baseline = dir.join("baseline.toml");
    fs::write(&baseline, DENY).unwrap();
    let hash = sha256_hex(&baseline);
    let lab = lab_with_baseline(&baseline);

    // The org allows *.wild.test: another name under it passes.
    let ok = lab.proxied_curl("http://a.wild.test/", &[]);
    assert_eq!(ok.status, 200, "{ok:?}");
    let r = lab.proxied_curl("http://evil.wild.test/", &[]);
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.body.contains("explicit_deny"), "{r:?}");
    let ip = lab.proxied_curl("http://198.18.2.30/", &[]);
    assert_eq!(ip.status, 403, "{ip:?}");
    let d = lab.dig(&["evil.wild.test", "A"]);
    assert_eq!(d.status, "REFUSED", "{}", d.output);

    let denied = lab.wait_evidence("evil.wild.test denied by the baseline", |v| {
        v["host"] == "evil.wild.test" && v["event"] == "decision" && v["kind"] == "http"
    });
    assert_eq!(denied["reason"], "explicit_deny", "{denied}");
    assert_eq!(denied["layer"], "baseline", "{denied}");
    assert_eq!(denied["rule"], "baseline:no-evil", "{denied}");
    assert_eq!(denied["baseline"], hash.as_str(), "{denied}");
    let by_ip = lab.wait_evidence("198.18.2.30 denied by the baseline", |v| {
        v["host"] == "198.18.2.30" && v["event"] == "decision"
    });
    assert_eq!(
        (&by_ip["reason"], &by_ip["layer"], &by_ip["rule"]),
        (
            &"explicit_deny".into(),
            &"baseline".into(),
            &"baseline:no-30".into()
        ),
        "{by_ip}"
    );
    let dns = lab.wait_evidence("evil.wild.test refused by the shim", |v| {
        v["host"] == "evil.wild.test" && v["kind"] == "dns"
    });
    assert_eq!(
        (&dns["layer"], &dns["baseline"]),
        (&"baseline".into(), &hash.as_str().into()),
        "{dns}"
    );
    let allowed = lab.wait_evidence("a.wild.test allowed by the org", |v| {
        v["host"] == "a.wild.test" && v["event"] == "decision" && v["decision"] == "allow"
    });
    assert_eq!(allowed["layer"], "org", "{allowed}");
    assert_eq!(allowed["baseline"], hash.as_str(), "{allowed}");

    // `explain` names the layer, from the same files.
    let cfg = lab.config_path.to_str().unwrap();
    let out = palisade(&[
        "explain",
        "-c",
        cfg,
        "--client",
        "198.18.1.5",
        "http://evil.wild.test/",
    ]);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(out.stdout.contains("layer:    baseline"), "{}", out.stdout);
    assert!(
        out.stdout.contains(&format!("baseline: {hash}")),
        "{}",
        out.stdout
    );
    let _ = fs::remove_dir_all(&dir);
}

fn reloads(lab: &Lab, result: &str) -> f64 {
    crate::metrics::scalar_from_scrape(
        lab,
        &format!("palisade_policy_reloads_total{{result=\"{result}\"}}"),
    )
}

/// Replace `path` atomically, as an editor or a ConfigMap update would.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    fs::write(&tmp, text).unwrap();
    fs::rename(&tmp, path).unwrap();
}

#[test]
fn a_broken_or_missing_baseline_keeps_the_old_policy_and_a_baseline_change_reloads() {
    let dir = scratch_dir("baseline-reload");
    let baseline = dir.join("baseline.toml");
    fs::write(&baseline, DENY).unwrap();
    let lab = lab_with_baseline(&baseline);
    assert_eq!(lab.proxied_curl("http://a.wild.test/", &[]).status, 200);
    assert_eq!(lab.proxied_curl("http://evil.wild.test/", &[]).status, 403);

    // Broken: an unknown key, and a deny of a.wild.test that must not apply.
    replace(
        &baseline,
        &format!("bogus = 1\n{DENY}\n[[deny]]\nhost = \"a.wild.test\"\n"),
    );
    lab.signal_proxy("-HUP");
    lab::wait_until("broken baseline refused", SECS10, || {
        reloads(&lab, "error") >= 1.0
    });
    assert_eq!(lab.proxied_curl("http://a.wild.test/", &[]).status, 200);
    assert_eq!(lab.proxied_curl("http://evil.wild.test/", &[]).status, 403);
    let log = lab.proxy_output();
    let located = format!("{}:1:1:", baseline.display());
    assert!(
        log.lines()
            .any(|l| l.contains(&located) && l.contains("bogus")),
        "no {located} error in the log:\n{log}"
    );

    // Missing: refused too; the old baseline keeps denying.
    let errors = reloads(&lab, "error");
    fs::remove_file(&baseline).unwrap();
    lab.signal_proxy("-HUP");
    lab::wait_until("missing baseline refused", SECS10, || {
        reloads(&lab, "error") > errors
    });
    assert_eq!(lab.proxied_curl("http://evil.wild.test/", &[]).status, 403);
    assert_eq!(lab.proxied_curl("http://a.wild.test/", &[]).status, 200);
    assert_eq!(lab.admin_status("/readyz"), 200);

    // A valid baseline, the config untouched and no signal: the poll sees
    // the change and the new deny applies.
    let now = format!("{DENY}\n[[deny]]\nid = \"no-a\"\nhost = \"a.wild.test\"\n");
    replace(&baseline, &now);
    let hash = sha256_hex(&baseline);
    lab::wait_until("baseline change served", SECS10, || {
        lab.proxied_curl("http://a.wild.test/", &[]).status == 403
    });
    // The 403 above may be a request in flight when the baseline changed,
    // revoked (`policy_revoked`, no rule): one more is decided afresh.
    assert_eq!(lab.proxied_curl("http://a.wild.test/", &[]).status, 403);
    let r = lab.wait_evidence("a.wild.test denied by the new baseline", |v| {
        v["host"] == "a.wild.test"
            && v["decision"] == "deny"
            && v["event"] == "decision"
            && v["reason"] == "explicit_deny"
    });
    assert_eq!(
        (&r["layer"], &r["rule"]),
        (&"baseline".into(), &"baseline:no-a".into()),
        "{r}"
    );
    assert_eq!(r["baseline"], hash.as_str(), "{r}");
    let _ = fs::remove_dir_all(&dir);
}
