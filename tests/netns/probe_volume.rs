//! `palisade probe` volume probes: `probe plan` adds one per budgeted
//! allow rule, `probe run` moves the budget plus a margin through it
//! inside the sandbox namespace, and `probe report` reads what left from
//! Palisade's close record (checked here against the upstream's own
//! count: an origin that reads and counts every byte it receives). An
//! enforcing org is `enforced_deny`, cut within the documented slack; a
//! report-mode org relays it all and is a finding (`unexpected_allow`).

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, palisade_bin, Lab};
use crate::probe::{probe_report, probe_run};
use crate::volume::Origin;

const SINK: &str = "198.18.2.30:7001";
/// The rule's budget up.
const BUDGET: u64 = 256 * 1024;
/// The documented slack (docs/decisions.md, "The slack"): one splice.
const SLACK: u64 = 256 * 1024;
/// What a volume probe tries: the budget plus twice the slack.
const TRIED: u64 = BUDGET + 2 * SLACK;

fn policy(mode: &str) -> String {
    format!(
        r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
{mode}

[[org.allow]]
id = "sink"
cidr = "198.18.2.30/32"
ports = [7001]
max_bytes_up = "256KiB"
volume_window = "1h"
"#
    )
}

/// `probe plan` for the lab's config, cut down to its volume probes.
fn volume_plan(lab: &Lab) -> String {
    let out = lab::run_with_timeout(
        Command::new(palisade_bin())
            .args(["probe", "plan", "-c"])
            .arg(&lab.config_path)
            .args(["--org", "acme"]),
        None,
        Duration::from_secs(10),
    );
    assert!(out.success(), "{}", out.describe());
    let mut plan: toml::Table = toml::from_str(&out.stdout).unwrap();
    let probes: Vec<toml::Value> = plan["probe"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p.get("volume").is_some())
        .cloned()
        .collect();
    assert_eq!(
        probes.len(),
        1,
        "one budget, one volume probe:\n{}",
        out.stdout
    );
    assert_eq!(probes[0]["id"].as_str(), Some("volume-0-up"));
    assert_eq!(probes[0]["target"].as_str(), Some("tcp://198.18.2.30:7001"));
    assert_eq!(probes[0]["budget"].as_integer(), Some(BUDGET as i64));
    plan.insert("probe".into(), toml::Value::Array(probes));
    toml::to_string(&plan).unwrap()
}

/// Plan, run and report the volume probe in a lab with `mode`: the
/// probe's row of the report, the report's exit status, and what the
/// upstream counted.
fn probe_the_budget(mode: &str, name: &str) -> (Value, Option<i32>, u64) {
    let lab = Lab::builder().policy(&policy(mode)).start();
    let sink = Origin::start(&lab, SINK);
    let plan = volume_plan(&lab);
    let obs = probe_run(&lab, &lab.ns_client, name, &plan);
    let upstream = sink.wait_received(1)[0];
    lab.wait_evidence("the close record", |v| {
        v["event"] == "close" && v["bytes_up"].as_u64().is_some_and(|n| n > 0)
    });
    let r = probe_report(&lab, name, &obs, &lab.evidence_dir, &["--allow-unsealed"]);
    let row = r.probe("volume-0-up").clone();
    eprintln!(
        "probe_volume {name}: budget {BUDGET}, tried {TRIED}, upstream counted {upstream}, report: {} ({})",
        row["class"], row["why"]
    );
    (row, r.code, upstream)
}

#[test]
fn a_budget_cut_within_the_slack_is_enforced_deny() {
    let (row, _, upstream) = probe_the_budget("", "volume-enforced");
    assert_eq!(row["class"], "enforced_deny", "{row:#}");
    let v = &row["volume"];
    assert_eq!(v["tried"], TRIED, "{v}");
    assert_eq!(
        v["relayed"], upstream,
        "the close record counts what the upstream got"
    );
    assert!(
        (BUDGET..=BUDGET + SLACK).contains(&upstream),
        "{upstream} bytes reached the upstream under {BUDGET}"
    );
    assert_eq!(v["cut"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(row["finding"], false, "{row:#}");
}

#[test]
fn a_report_mode_org_passing_its_budget_is_a_finding() {
    let (row, code, upstream) = probe_the_budget("mode = \"report\"", "volume-report");
    assert_eq!(row["class"], "unexpected_allow", "{row:#}");
    assert_eq!(upstream, TRIED, "report mode relays it all");
    let v = &row["volume"];
    assert_eq!(v["relayed"], TRIED, "{v}");
    assert_eq!(v["would_deny"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(row["finding"], true);
    assert_eq!(code, Some(1), "a finding makes the report exit 1");
}
