//! The comparison, pure: two rulesets in `nft -j` form (the one the
//! ruleset file defines, loaded into a scratch namespace and listed; the
//! one the kernel has loaded) in, the differences out.
//!
//! What is compared, per table the file defines (tables it does not
//! define, such as another tool's, are not looked at):
//!
//! | in the file | in the kernel | difference |
//! |---|---|---|
//! | table | absent | `table F T is not loaded` |
//! | chain | absent | `chain F T C is not loaded` |
//! | base chain | other type, hook, priority, policy or device | `chain F T C is ... in the kernel, ... in the file` |
//! | chain's rules | another list (a rule added, removed, changed or moved) | `chain F T C: rule N differs (K rules loaded, the file has M)` |
//! | none | a chain in the table | `chain F T C is loaded but not in the file` |
//! | set, map, other named object | absent or other (type, flags, elements) | `set F T S is not loaded` / `... differs` |
//!
//! Run-time state is no difference: handles, counter and quota values,
//! and the elements of sets the packet path fills (`dynamic` or `timeout`
//! flags) are left out of both sides before they are compared.

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::BTreeMap;
use std::fmt;

use serde_json::{Map, Value};

/// A ruleset's tables, as compared.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Ruleset {
    tables: BTreeMap<TableId, Table>,
}

/// `family name` of a table, e.g. `inet palisade`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct TableId {
    pub family: String,
    pub name: String,
}

impl fmt::Display for TableId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.family, self.name)
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Table {
    /// In the order listed.
    chains: Vec<(String, Chain)>,
    /// Sets, maps, counters, quotas, ...: `(kind, name)` to its normalised
    /// JSON.
    objects: BTreeMap<(String, String), Value>,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Chain {
    /// A base chain's type, hook, priority, policy and device, as text.
    base: Option<String>,
    /// Each rule's expressions and comment, normalised.
    rules: Vec<Value>,
}

/// The JSON is not what `nft -j list ruleset` prints.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an nft JSON ruleset: {0}")]
pub(crate) struct NotARuleset(String);

impl Ruleset {
    /// Read the output of `nft -j list ruleset`.
    pub(crate) fn from_json(text: &[u8]) -> Result<Ruleset, NotARuleset> {
        let value: Value = serde_json::from_slice(text).map_err(|e| NotARuleset(e.to_string()))?;
        let items = value
            .get("nftables")
            .and_then(Value::as_array)
            .ok_or_else(|| NotARuleset("no \"nftables\" array".into()))?;
        let mut set = Ruleset::default();
        for item in items {
            let Some((kind, body)) = item.as_object().and_then(|o| o.iter().next()) else {
                return Err(NotARuleset(format!("an item is not an object: {item}")));
            };
            set.add(kind, body)?;
        }
        Ok(set)
    }

    fn add(&mut self, kind: &str, body: &Value) -> Result<(), NotARuleset> {
        let text = |key: &str| body.get(key).and_then(Value::as_str).map(str::to_string);
        let missing = || NotARuleset(format!("{kind} without family, table or name: {body}"));
        if kind == "metainfo" {
            return Ok(());
        }
        let family = text("family").ok_or_else(missing)?;
        if kind == "table" {
            let name = text("name").ok_or_else(missing)?;
            self.tables.entry(TableId { family, name }).or_default();
            return Ok(());
        }
        let table = text("table").ok_or_else(missing)?;
        let table = self
            .tables
            .entry(TableId {
                family,
                name: table,
            })
            .or_default();
        match kind {
            "chain" => {
                let name = text("name").ok_or_else(missing)?;
                let base = text("hook").map(|hook| {
                    let mut words = vec![
                        format!("type {}", text("type").unwrap_or_default()),
                        format!("hook {hook}"),
                        format!("priority {}", body.get("prio").unwrap_or(&Value::Null)),
                        format!(
                            "policy {}",
                            text("policy").unwrap_or_else(|| "accept".into())
                        ),
                    ];
                    if let Some(dev) = body.get("dev") {
                        words.push(format!("device {dev}"));
                    }
                    words.join(" ")
                });
                match table.chains.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, chain)) => chain.base = base,
                    None => table.chains.push((
                        name,
                        Chain {
                            base,
                            rules: Vec::new(),
                        },
                    )),
                }
            }
            "rule" => {
                let chain = text("chain").ok_or_else(missing)?;
                let mut rule = Map::new();
                for key in ["expr", "comment"] {
                    if let Some(v) = body.get(key) {
                        rule.insert(key.into(), normalised(v));
                    }
                }
                let rules = match table.chains.iter_mut().find(|(n, _)| *n == chain) {
                    Some((_, c)) => &mut c.rules,
                    None => {
                        table.chains.push((chain, Chain::default()));
                        &mut table.chains.last_mut().expect("just pushed").1.rules
                    }
                };
                rules.push(Value::Object(rule));
            }
            _ => {
                let name = text("name").ok_or_else(missing)?;
                let mut value = normalised(body);
                let filled = body
                    .get("flags")
                    .and_then(Value::as_array)
                    .is_some_and(|f| f.iter().any(|f| f == "dynamic" || f == "timeout"));
                if filled {
                    if let Value::Object(o) = &mut value {
                        o.remove("elem");
                    }
                }
                table.objects.insert((kind.to_string(), name), value);
            }
        }
        Ok(())
    }

    /// The tables, by id.
    pub(crate) fn tables(&self) -> impl Iterator<Item = &TableId> {
        self.tables.keys()
    }
}

/// Keys whose values are run-time state, not configuration.
const STATE_KEYS: [&str; 5] = ["handle", "packets", "bytes", "used", "expires"];

/// `v` without run-time state, at any depth.
fn normalised(v: &Value) -> Value {
    match v {
        Value::Object(o) => Value::Object(
            o.iter()
                .filter(|(k, _)| !STATE_KEYS.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), normalised(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(normalised).collect()),
        other => other.clone(),
    }
}

/// One way the kernel's ruleset is not the file's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Difference {
    TableMissing(TableId),
    ChainMissing(TableId, String),
    ChainExtra(TableId, String),
    ChainHook {
        table: TableId,
        chain: String,
        loaded: String,
        expected: String,
    },
    Rules {
        table: TableId,
        chain: String,
        /// 1-based position of the first rule that differs.
        first: usize,
        loaded: usize,
        expected: usize,
    },
    ObjectMissing(TableId, String, String),
    ObjectDiffers(TableId, String, String),
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Difference::TableMissing(t) => write!(f, "table {t} is not loaded"),
            Difference::ChainMissing(t, c) => write!(f, "chain {t} {c} is not loaded"),
            Difference::ChainExtra(t, c) => write!(f, "chain {t} {c} is loaded but not in the file"),
            Difference::ChainHook {
                table,
                chain,
                loaded,
                expected,
            } => {
                let show = |s: &str| if s.is_empty() { "a regular chain".to_string() } else { s.to_string() };
                write!(
                    f,
                    "chain {table} {chain} is {} in the kernel, {} in the file",
                    show(loaded),
                    show(expected)
                )
            }
            Difference::Rules {
                table,
                chain,
                first,
                loaded,
                expected,
            } => write!(
                f,
                "chain {table} {chain}: rule {first} differs ({loaded} rules loaded, the file has {expected})"
            ),
            Difference::ObjectMissing(t, kind, name) => write!(f, "{kind} {t} {name} is not loaded"),
            Difference::ObjectDiffers(t, kind, name) => write!(f, "{kind} {t} {name} differs"),
        }
    }
}

/// Every way `loaded` differs from `expected` in the tables `expected`
/// defines (see the module's table); empty: enforcement is in place.
pub(crate) fn differences(expected: &Ruleset, loaded: &Ruleset) -> Vec<Difference> {
    let mut out = Vec::new();
    for (id, want) in &expected.tables {
        let Some(have) = loaded.tables.get(id) else {
            out.push(Difference::TableMissing(id.clone()));
            continue;
        };
        for (name, chain) in &want.chains {
            let Some((_, got)) = have.chains.iter().find(|(n, _)| n == name) else {
                out.push(Difference::ChainMissing(id.clone(), name.clone()));
                continue;
            };
            if got.base != chain.base {
                out.push(Difference::ChainHook {
                    table: id.clone(),
                    chain: name.clone(),
                    loaded: got.base.clone().unwrap_or_default(),
                    expected: chain.base.clone().unwrap_or_default(),
                });
            }
            if got.rules != chain.rules {
                let first = got
                    .rules
                    .iter()
                    .zip(&chain.rules)
                    .take_while(|(a, b)| a == b)
                    .count();
                out.push(Difference::Rules {
                    table: id.clone(),
                    chain: name.clone(),
                    first: first + 1,
                    loaded: got.rules.len(),
                    expected: chain.rules.len(),
                });
            }
        }
        for (name, _) in &have.chains {
            if !want.chains.iter().any(|(n, _)| n == name) {
                out.push(Difference::ChainExtra(id.clone(), name.clone()));
            }
        }
        for ((kind, name), value) in &want.objects {
            match have.objects.get(&(kind.clone(), name.clone())) {
                None => out.push(Difference::ObjectMissing(
                    id.clone(),
                    kind.clone(),
                    name.clone(),
                )),
                Some(v) if v != value => out.push(Difference::ObjectDiffers(
                    id.clone(),
                    kind.clone(),
                    name.clone(),
                )),
                Some(_) => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A ruleset of `items`, as nft lists it.
    fn set(items: Vec<Value>) -> Ruleset {
        let mut all = vec![json!({"metainfo": {"version": "1.0.6", "json_schema_version": 1}})];
        all.extend(items);
        Ruleset::from_json(json!({ "nftables": all }).to_string().as_bytes()).unwrap()
    }

    fn table(family: &str, name: &str) -> Value {
        json!({"table": {"family": family, "name": name, "handle": 3}})
    }

    fn base(name: &str, hook: &str, policy: &str) -> Value {
        json!({"chain": {"family": "inet", "table": "palisade", "name": name, "handle": 1,
            "type": "filter", "hook": hook, "prio": 0, "policy": policy}})
    }

    fn rule(chain: &str, handle: u64, packets: u64, verdict: &str) -> Value {
        json!({"rule": {"family": "inet", "table": "palisade", "chain": chain, "handle": handle,
            "expr": [{"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "sandbox0"}},
                     {"counter": {"packets": packets, "bytes": packets * 60}},
                     {verdict: null}]}})
    }

    /// The file's ruleset: one table, a forward chain that drops, an
    /// input chain of two rules, a static set and a dynamic one.
    fn file() -> Vec<Value> {
        loaded_as(0, 0, &[])
    }

    /// [`file`] as the kernel lists it after a while: other handles (from
    /// `at`), `packets` counted, `seen` filled in the dynamic set.
    fn loaded_as(at: u64, packets: u64, seen: &[&str]) -> Vec<Value> {
        let mut dynamic = json!({"family": "inet", "table": "palisade", "name": "seen",
            "handle": at + 7, "type": "ipv4_addr", "flags": ["dynamic"]});
        if !seen.is_empty() {
            dynamic["elem"] = json!(seen);
        }
        vec![
            table("inet", "palisade"),
            base("input", "input", "accept"),
            base("forward", "forward", "drop"),
            rule("input", at + 4, packets, "accept"),
            rule("input", at + 5, packets, "drop"),
            json!({"set": {"family": "inet", "table": "palisade", "name": "ok", "handle": at + 6,
                "type": "ipv4_addr", "elem": ["198.18.0.1"]}}),
            json!({ "set": dynamic }),
        ]
    }

    fn diff(loaded: Vec<Value>) -> Vec<String> {
        differences(&set(file()), &set(loaded))
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn the_same_tables_with_other_state_and_other_tables_do_not_differ() {
        let mut loaded = vec![table("ip", "docker")];
        loaded.extend(loaded_as(50, 1234, &["198.18.0.9"]));
        loaded
            .push(json!({"chain": {"family": "ip", "table": "docker", "name": "x", "handle": 1}}));
        assert_eq!(diff(loaded), Vec::<String>::new());
    }

    #[test]
    fn each_difference_is_named() {
        // Nothing loaded.
        assert_eq!(diff(vec![]), ["table inet palisade is not loaded"]);
        // Same name, other family: still not loaded.
        assert_eq!(
            diff(vec![table("ip", "palisade")]),
            ["table inet palisade is not loaded"]
        );
        // Table flushed: every chain and object is missing.
        assert_eq!(
            diff(vec![table("inet", "palisade")]),
            [
                "chain inet palisade input is not loaded",
                "chain inet palisade forward is not loaded",
                "set inet palisade ok is not loaded",
                "set inet palisade seen is not loaded",
            ]
        );
        let mut same = file();
        // A policy flipped to accept, a rule removed, a chain added, a set emptied.
        same[2] = base("forward", "forward", "accept");
        same.remove(4);
        same.push(base("sneaky", "output", "accept"));
        same[4] = json!({"set": {"family": "inet", "table": "palisade", "name": "ok",
            "type": "ipv4_addr"}});
        assert_eq!(
            diff(same),
            [
                "chain inet palisade input: rule 2 differs (1 rules loaded, the file has 2)",
                "chain inet palisade forward is type filter hook forward priority 0 policy accept in the kernel, type filter hook forward priority 0 policy drop in the file",
                "chain inet palisade sneaky is loaded but not in the file",
                "set inet palisade ok differs",
            ]
        );
        // A rule changed in place (accept for drop) and one moved.
        let mut changed = file();
        changed[4] = rule("input", 5, 0, "accept");
        assert_eq!(
            diff(changed),
            ["chain inet palisade input: rule 2 differs (2 rules loaded, the file has 2)"]
        );
        let mut moved = file();
        moved.swap(3, 4);
        assert_eq!(
            diff(moved),
            ["chain inet palisade input: rule 1 differs (2 rules loaded, the file has 2)"]
        );
        // A base chain turned regular (no hook: nothing reaches it).
        let mut regular = file();
        regular[2] = json!({"chain": {"family": "inet", "table": "palisade", "name": "forward"}});
        assert_eq!(
            diff(regular),
            ["chain inet palisade forward is a regular chain in the kernel, type filter hook forward priority 0 policy drop in the file"]
        );
    }

    #[test]
    fn what_is_not_a_listing_is_refused() {
        for bad in [
            "",
            "[]",
            "{\"nftables\": 1}",
            "{\"nftables\": [1]}",
            "{\"nftables\": [{\"chain\": {\"name\": \"x\"}}]}",
        ] {
            assert!(Ruleset::from_json(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
