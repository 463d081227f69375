//! Volume budgets: how many bytes an org may move through one allow rule
//! (and through all its rules together) in any span of a sliding window,
//! each direction on its own (`max_bytes_up`, `max_bytes_down` over
//! `volume_window`, [`Volume`]). The policy says how much; this holds what
//! was spent, with the time passed in, consulted at the edges (the proxy's
//! admission before dialling, every relay as it moves bytes).
//!
//! | step | call | what it does |
//! |---|---|---|
//! | admission | [`Volumes::admit`] | refuses (`volume_exceeded`, with when to retry) while any budget the decision spends from has nothing left in a direction it bounds; otherwise a [`Lease`] on them, or `None` when none applies (nothing is counted: the relay keeps its zero-copy path untouched) |
//! | relaying | [`Lease::spend`] | the bytes moved, charged to every budget the lease holds, saying when one is spent (the relay is then cut) |
//! | relaying a body | [`Lease::take`] | the bytes about to move, as many as are left, charged; told which budget held the rest back |
//! | the admin port | [`Volumes::state`] | each budget's live state: limit, used, left |
//!
//! **The window.** Each budget direction keeps [`SLOTS`] counts, each
//! `window / SLOTS` wide. A byte is forgotten when the whole of its slot
//! is older than the window, so it is held between `window` and `window +
//! window / SLOTS`: in no span of `window` does more than the budget pass
//! (plus the relay's slack, below), and what is spent is freed at most
//! one slot-width late.
//!
//! **Slack.** A tunnel is charged after each transfer (one read of its
//! copy buffer, at most 64 KiB, or one splice, at most 256 KiB: the tunnel
//! keeps its zero-copy path) and cut at once when that transfer spent the
//! budget: it passes the budget by at most that one transfer. Tunnels
//! relaying under the same budget at the same moment each may pass it by
//! one transfer. A forwarded or intercepted request's bodies take what
//! they relay with [`Lease::take`], piece by piece, before each piece
//! goes: the piece that would pass the budget is cut to what is left, so
//! a body never passes it.
//!
//! **Memory.** One entry per (org, rule) with a budget and per org with
//! one, created at first use: the config bounds them. Entries of rules a
//! reload removed go when nothing holds them and their window is empty;
//! past [`MAX_METERS`] entries an admission is refused (fail closed), never
//! let through uncounted.
//!
//! **Reloads.** Entries are keyed by org name and rule id, not by the
//! policy: a rule that stays (same id) keeps what it spent. A changed
//! window keeps the bytes spent, freed one new window later; a changed
//! limit applies to the next admission.

use foldhash::{HashMap, HashMapExt};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use prometheus::IntCounterVec;

use crate::config::Volume;

/// Counts per window and direction.
pub(crate) const SLOTS: u32 = 60;

/// Budget entries held at most.
pub(crate) const MAX_METERS: usize = 65_536;

/// Which way bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Direction {
    /// Client to upstream (`max_bytes_up`).
    Up,
    /// Upstream to client (`max_bytes_down`).
    Down,
}

impl Direction {
    /// The metric label and the name in records.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Direction::Up => "up",
            Direction::Down => "down",
        }
    }

    fn limit(self, v: &Volume) -> Option<u64> {
        match self {
            Direction::Up => v.up,
            Direction::Down => v.down,
        }
    }
}

/// Whose budget: one rule of an org, or the org's total.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Scope {
    /// Allow rule `id`.
    Rule(Arc<str>),
    /// Every rule of the org together (the budget on `[[org]]`).
    Org,
}

impl Scope {
    /// The rule id, or `*` for the org's total.
    pub(crate) fn name(&self) -> &str {
        match self {
            Scope::Rule(id) => id,
            Scope::Org => "*",
        }
    }
}

/// One direction's sliding window: `(slot, bytes)` oldest first, a slot
/// being the number of slot-widths since the budgets' origin.
#[derive(Debug, Default)]
struct Slots {
    spent: std::collections::VecDeque<(u64, u64)>,
    used: u64,
}

impl Slots {
    /// Forget the slots wholly older than the window at slot `now`.
    fn expire(&mut self, now: u64) {
        while let Some(&(slot, bytes)) = self.spent.front() {
            if slot + u64::from(SLOTS) >= now {
                break;
            }
            self.spent.pop_front();
            self.used = self.used.saturating_sub(bytes);
        }
    }

    fn add(&mut self, now: u64, bytes: u64) {
        self.used = self.used.saturating_add(bytes);
        match self.spent.back_mut() {
            Some((slot, b)) if *slot >= now => *b = b.saturating_add(bytes),
            _ => self.spent.push_back((now, bytes)),
        }
    }

    /// The first slot at which fewer than `limit` bytes are held.
    fn free_at(&self, limit: u64) -> u64 {
        let mut used = self.used;
        for &(slot, bytes) in &self.spent {
            if used < limit {
                break;
            }
            used = used.saturating_sub(bytes);
            if used < limit {
                return slot + u64::from(SLOTS) + 1;
            }
        }
        0
    }
}

/// One budget's state: its window and what each direction spent.
#[derive(Debug)]
struct Meter {
    width: Duration,
    up: Slots,
    down: Slots,
}

impl Meter {
    fn new(window: Duration) -> Meter {
        Meter {
            width: (window / SLOTS).max(Duration::from_millis(1)),
            up: Slots::default(),
            down: Slots::default(),
        }
    }

    fn slot(&self, since_origin: Duration) -> u64 {
        u64::try_from(since_origin.as_nanos() / self.width.as_nanos().max(1)).unwrap_or(u64::MAX)
    }

    /// Up to date at `since_origin` under `window` (a reload may have
    /// changed it: what was spent is kept, as one slot of the new width).
    fn at(&mut self, window: Duration, since_origin: Duration) -> u64 {
        let width = (window / SLOTS).max(Duration::from_millis(1));
        if width != self.width {
            let (up, down) = (self.up.used, self.down.used);
            *self = Meter::new(window);
            let now = self.slot(since_origin);
            for (slots, bytes) in [(&mut self.up, up), (&mut self.down, down)] {
                if bytes > 0 {
                    slots.add(now, bytes);
                }
            }
        }
        let now = self.slot(since_origin);
        self.up.expire(now);
        self.down.expire(now);
        now
    }

    fn dir(&mut self, d: Direction) -> &mut Slots {
        match d {
            Direction::Up => &mut self.up,
            Direction::Down => &mut self.down,
        }
    }
}

type Key = (Arc<str>, Scope);

/// A budget's entry: its limits as last admitted, and its state.
type Entry = (Volume, Arc<Mutex<Meter>>);

/// A refusal: the budget that is spent, and when it frees enough for a
/// new connection.
#[derive(Debug, Clone)]
pub(crate) struct Exceeded {
    pub scope: Scope,
    pub direction: Direction,
    pub limit: u64,
    pub window: Duration,
    /// Until the window frees enough (`None`: the budget table is full,
    /// not a window: no time can be promised).
    pub retry_after: Option<Duration>,
    /// The budgets it would have spent from (for a report-mode org, let
    /// through and counted); `None` when the table is full.
    pub lease: Option<Lease>,
}

impl Exceeded {
    /// The detail of the `volume_exceeded` record and refusal.
    pub(crate) fn detail(&self) -> String {
        match self.retry_after {
            Some(_) => format!(
                "volume budget spent: {} bytes {} per {}s under {}",
                self.limit,
                self.direction.as_str(),
                self.window.as_secs(),
                match &self.scope {
                    Scope::Rule(id) => format!("rule {id}"),
                    Scope::Org => "the org's total".to_string(),
                }
            ),
            None => "volume budgets: table full".to_string(),
        }
    }
}

/// The budgets one admitted connection or request spends from, held
/// while it relays (one pointer: every tunnel task carries it).
#[derive(Debug, Clone)]
pub(crate) struct Lease(Arc<Leased>);

#[derive(Debug)]
struct Leased {
    origin: Instant,
    meters: Vec<(Scope, Volume, Arc<Mutex<Meter>>)>,
}

fn lock(m: &Mutex<Meter>) -> MutexGuard<'_, Meter> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Lease {
    /// Bytes that may still move `direction` at `now` (the least left of
    /// the budgets that bound it; `None`: unbounded).
    #[cfg(test)]
    fn left(&self, direction: Direction, now: Instant) -> Option<u64> {
        let since = now.saturating_duration_since(self.0.origin);
        let mut least: Option<u64> = None;
        for (_, volume, meter) in &self.0.meters {
            let Some(limit) = direction.limit(volume) else {
                continue;
            };
            let mut m = lock(meter);
            m.at(volume.window, since);
            let left = limit.saturating_sub(m.dir(direction).used);
            least = Some(least.map_or(left, |l| l.min(left)));
        }
        least
    }

    /// `bytes` moved `direction` at `now`: charged to every budget (those
    /// that do not bound the direction too, for the admin port's view).
    /// The budget now spent, if one is: the relay is to be cut. When one
    /// transfer spent several, the one it crossed first (the least left
    /// before it) is named.
    pub(crate) fn spend(&self, direction: Direction, bytes: u64, now: Instant) -> Option<Scope> {
        let since = now.saturating_duration_since(self.0.origin);
        let mut spent: Option<(u64, &Scope)> = None;
        for (scope, volume, meter) in &self.0.meters {
            let mut m = lock(meter);
            let slot = m.at(volume.window, since);
            let slots = m.dir(direction);
            let before = slots.used;
            slots.add(slot, bytes);
            if let Some(limit) = direction.limit(volume).filter(|l| slots.used >= *l) {
                let left = limit.saturating_sub(before);
                if spent.is_none_or(|(least, _)| left < least) {
                    spent = Some((left, scope));
                }
            }
        }
        spent.map(|(_, scope)| scope.clone())
    }

    /// Up to `bytes` about to move `direction` at `now`: as many as every
    /// budget bounding the direction has left (all of them when `whole`,
    /// a report-mode org's), charged to every budget, with the budget
    /// that held the rest back (or, when `whole`, that they passed). The
    /// budgets are held together while they are charged, so relays
    /// spending at once never pass a budget between them.
    pub(crate) fn take(
        &self,
        direction: Direction,
        bytes: u64,
        now: Instant,
        whole: bool,
    ) -> (u64, Option<Scope>) {
        let since = now.saturating_duration_since(self.0.origin);
        // Always locked in the lease's order (the rule's, then the org's).
        let mut held: Vec<_> = self
            .0
            .meters
            .iter()
            .map(|(scope, volume, m)| {
                let mut m = lock(m);
                let slot = m.at(volume.window, since);
                (scope, volume, m, slot)
            })
            .collect();
        let mut least: Option<(u64, &Scope)> = None;
        for (scope, volume, m, _) in &mut held {
            if let Some(limit) = direction.limit(volume) {
                let left = limit.saturating_sub(m.dir(direction).used);
                if least.is_none_or(|(l, _)| left < l) {
                    least = Some((left, *scope));
                }
            }
        }
        let (granted, over) = match least {
            Some((left, scope)) if left < bytes => {
                (if whole { bytes } else { left }, Some(scope.clone()))
            }
            _ => (bytes, None),
        };
        if granted > 0 {
            for (_, _, m, slot) in &mut held {
                m.dir(direction).add(*slot, granted);
            }
        }
        (granted, over)
    }

    /// The limit and window of `scope`'s budget, if the lease holds it.
    pub(crate) fn volume(&self, scope: &Scope) -> Option<Volume> {
        self.0
            .meters
            .iter()
            .find(|(s, _, _)| s == scope)
            .map(|(_, v, _)| *v)
    }
}

/// One budget's live state, for the admin port.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct BudgetState {
    pub org: String,
    /// The rule id, or `*` for the org's total.
    pub rule: String,
    pub window_secs: u64,
    pub up: DirectionState,
    pub down: DirectionState,
}

/// One direction of a budget: what the window holds, and what is left
/// (`limit` and `left` absent where the direction is unbounded).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct DirectionState {
    pub used: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub left: Option<u64>,
}

/// Every org's budgets, shared by every mode and listener.
pub(crate) struct Volumes {
    origin: Instant,
    meters: Mutex<HashMap<Key, Entry>>,
    cap: usize,
    /// `palisade_volume_exceeded_total{org, direction}`: refusals and cuts.
    exceeded: Option<IntCounterVec>,
}

impl Volumes {
    /// Budgets whose windows count from `origin`, at most `cap` entries,
    /// counting refusals and cuts into `exceeded` when given.
    pub(crate) fn new(origin: Instant, cap: usize, exceeded: Option<IntCounterVec>) -> Volumes {
        Volumes {
            origin,
            meters: Mutex::new(HashMap::new()),
            cap,
            exceeded,
        }
    }

    /// Count one refusal or cut of `org` in `direction`.
    pub(crate) fn count(&self, org: &str, direction: Direction) {
        if let Some(c) = &self.exceeded {
            c.with_label_values(&[org, direction.as_str()]).inc();
        }
    }

    /// A new connection or request of `org` under allow rule `rule`, whose
    /// budget is `by_rule`, the org's being `by_org`, at `now`. `Ok(None)`:
    /// no budget applies. Refusals are counted in the metric.
    pub(crate) fn admit(
        &self,
        org: &Arc<str>,
        rule: &Arc<str>,
        (by_rule, by_org): (Option<Volume>, Option<Volume>),
        now: Instant,
    ) -> Result<Option<Lease>, Exceeded> {
        let wanted: Vec<(Scope, Volume)> = [
            by_rule.map(|v| (Scope::Rule(rule.clone()), v)),
            by_org.map(|v| (Scope::Org, v)),
        ]
        .into_iter()
        .flatten()
        .collect();
        if wanted.is_empty() {
            return Ok(None);
        }
        let since = now.saturating_duration_since(self.origin);
        let mut lease = Leased {
            origin: self.origin,
            meters: Vec::with_capacity(wanted.len()),
        };
        {
            let mut meters = self.meters.lock().unwrap_or_else(|e| e.into_inner());
            for (scope, volume) in wanted {
                let key = (org.clone(), scope.clone());
                if !meters.contains_key(&key) && meters.len() >= self.cap {
                    meters.retain(|_, (v, m)| {
                        Arc::strong_count(m) > 1 || {
                            let mut m = lock(m);
                            m.at(v.window, since);
                            m.up.used > 0 || m.down.used > 0
                        }
                    });
                    if meters.len() >= self.cap {
                        self.count(org, Direction::Up);
                        return Err(Exceeded {
                            scope,
                            direction: Direction::Up,
                            limit: volume.up.or(volume.down).unwrap_or(0),
                            window: volume.window,
                            retry_after: None,
                            lease: None,
                        });
                    }
                }
                let entry = meters
                    .entry(key)
                    .or_insert_with(|| (volume, Arc::new(Mutex::new(Meter::new(volume.window)))));
                entry.0 = volume;
                lease.meters.push((scope, volume, entry.1.clone()));
            }
        }
        let lease = Lease(Arc::new(lease));
        // Refused while any bounded direction has nothing left.
        for (scope, volume, meter) in &lease.0.meters {
            let mut m = lock(meter);
            let slot = m.at(volume.window, since);
            for direction in [Direction::Up, Direction::Down] {
                let Some(limit) = direction.limit(volume) else {
                    continue;
                };
                let slots = m.dir(direction);
                if slots.used >= limit {
                    let free = slots.free_at(limit).max(slot + 1);
                    let nanos = m.width.as_nanos().saturating_mul(u128::from(free));
                    let free_since = Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
                    self.count(org, direction);
                    return Err(Exceeded {
                        scope: scope.clone(),
                        direction,
                        limit,
                        window: volume.window,
                        retry_after: Some(free_since.saturating_sub(since)),
                        lease: Some(lease.clone()),
                    });
                }
            }
        }
        Ok(Some(lease))
    }

    /// Every budget's state at `now`, sorted by org and rule.
    pub(crate) fn state(&self, now: Instant) -> Vec<BudgetState> {
        let since = now.saturating_duration_since(self.origin);
        let meters = self.meters.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<BudgetState> = meters
            .iter()
            .map(|((org, scope), (volume, meter))| {
                let mut m = lock(meter);
                m.at(volume.window, since);
                let dir = |d: Direction, used: u64| {
                    let limit = d.limit(volume);
                    DirectionState {
                        used,
                        limit,
                        left: limit.map(|l| l.saturating_sub(used)),
                    }
                };
                BudgetState {
                    org: org.to_string(),
                    rule: scope.name().to_string(),
                    window_secs: volume.window.as_secs(),
                    up: dir(Direction::Up, m.up.used),
                    down: dir(Direction::Down, m.down.used),
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.org, &a.rule).cmp(&(&b.org, &b.rule)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn vol(up: Option<u64>, down: Option<u64>) -> Volume {
        Volume {
            up,
            down,
            window: MIN,
        }
    }

    fn ids() -> (Arc<str>, Arc<str>, Arc<str>, Arc<str>) {
        (
            Arc::from("acme"),
            Arc::from("beta"),
            Arc::from("gh"),
            Arc::from("pkg"),
        )
    }

    #[test]
    fn no_budget_no_lease() {
        let (acme, _, gh, _) = ids();
        let v = Volumes::new(Instant::now(), MAX_METERS, None);
        assert!(v
            .admit(&acme, &gh, (None, None), Instant::now())
            .unwrap()
            .is_none());
        assert!(v.state(Instant::now()).is_empty());
    }

    #[test]
    fn a_rule_budget_is_spent_refused_and_freed_by_the_window() {
        let (acme, _, gh, _) = ids();
        let t0 = Instant::now();
        let v = Volumes::new(t0, MAX_METERS, None);
        let budget = (Some(vol(Some(1000), None)), None);
        let lease = v.admit(&acme, &gh, budget, t0).unwrap().unwrap();
        assert_eq!(lease.left(Direction::Up, t0), Some(1000));
        assert_eq!(lease.left(Direction::Down, t0), None);
        assert_eq!(lease.spend(Direction::Up, 600, t0), None);
        assert_eq!(lease.spend(Direction::Down, 1 << 30, t0), None);
        assert_eq!(lease.left(Direction::Up, t0), Some(400));
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(
            lease.spend(Direction::Up, 400, t1),
            Some(Scope::Rule(gh.clone()))
        );
        assert_eq!(lease.left(Direction::Up, t1), Some(0));
        // A new connection is refused, told to come back when the first
        // 600 bytes (slot 0, one second wide) leave the window: 61 s
        // after t0.
        let e = v.admit(&acme, &gh, budget, t1).unwrap_err();
        assert_eq!(e.scope, Scope::Rule(gh.clone()));
        assert_eq!(e.direction, Direction::Up);
        assert_eq!(e.retry_after, Some(Duration::from_secs(51)));
        assert!(e.detail().contains("1000 bytes up per 60s under rule gh"));
        // Still spent just before, free at the promised time.
        let almost = t0 + Duration::from_millis(60_999);
        assert!(v.admit(&acme, &gh, budget, almost).is_err());
        let t2 = t0 + Duration::from_secs(61);
        let again = v.admit(&acme, &gh, budget, t2).unwrap().unwrap();
        assert_eq!(again.left(Direction::Up, t2), Some(600));
        // The 400 of t1 go at t1 + 61 s.
        let t3 = t1 + Duration::from_secs(61);
        assert_eq!(again.left(Direction::Up, t3), Some(1000));
    }

    #[test]
    fn in_no_span_of_the_window_does_more_than_the_budget_pass() {
        // A client spending whatever is left every 250 ms for five
        // windows: every window-long span holds at most the budget.
        let (acme, _, gh, _) = ids();
        let t0 = Instant::now();
        let v = Volumes::new(t0, MAX_METERS, None);
        let budget = (Some(vol(Some(10_000), None)), None);
        let mut log: Vec<(Duration, u64)> = Vec::new();
        for step in 0..(5 * 240) {
            let at = Duration::from_millis(250 * step);
            let now = t0 + at;
            if let Ok(Some(lease)) = v.admit(&acme, &gh, budget, now) {
                let left = lease.left(Direction::Up, now).unwrap();
                let n = left.min(777);
                lease.spend(Direction::Up, n, now);
                log.push((at, n));
            }
        }
        let total: u64 = log.iter().map(|l| l.1).sum();
        assert!(total > 40_000, "the budget is freed again: {total}");
        for (start, _) in &log {
            let in_span: u64 = log
                .iter()
                .filter(|(at, _)| *at >= *start && *at < *start + MIN)
                .map(|l| l.1)
                .sum();
            assert!(in_span <= 10_000, "{in_span} from {start:?}");
        }
    }

    /// One transfer that crosses a rule's budget and the org's total is
    /// cut by the one it crossed first: the org's 100 left before the
    /// rule's 1000 (a splice moves up to 256 KiB at once).
    #[test]
    fn a_transfer_over_two_budgets_names_the_one_it_crossed_first() {
        let (acme, _, gh, pkg) = ids();
        let t0 = Instant::now();
        let v = Volumes::new(t0, MAX_METERS, None);
        let rule = Some(vol(Some(1000), None));
        let org = Some(vol(Some(1500), None));
        let a = v.admit(&acme, &pkg, (rule, org), t0).unwrap().unwrap();
        assert_eq!(
            a.spend(Direction::Up, 1400, t0),
            Some(Scope::Rule(pkg.clone()))
        );
        let b = v.admit(&acme, &gh, (rule, org), t0).unwrap().unwrap();
        assert_eq!(b.spend(Direction::Up, 1200, t0), Some(Scope::Org));
    }

    #[test]
    fn orgs_and_rules_apart_the_org_total_over_rules() {
        let (acme, beta, gh, pkg) = ids();
        let t0 = Instant::now();
        let v = Volumes::new(t0, MAX_METERS, None);
        let rule = Some(vol(Some(1000), Some(500)));
        let org = Some(vol(Some(1500), None));
        let a = v.admit(&acme, &gh, (rule, org), t0).unwrap().unwrap();
        assert_eq!(a.spend(Direction::Up, 900, t0), None);
        // Another rule of the same org: its own 1000, the org's 600 left.
        let b = v.admit(&acme, &pkg, (rule, org), t0).unwrap().unwrap();
        assert_eq!(b.left(Direction::Up, t0), Some(600));
        assert_eq!(b.spend(Direction::Up, 600, t0), Some(Scope::Org));
        // Both rules of acme are now refused by the org's total...
        let e = v.admit(&acme, &gh, (rule, org), t0).unwrap_err();
        assert_eq!(e.scope, Scope::Org);
        assert!(e.detail().contains("the org's total"));
        // ... and beta is untouched.
        let c = v.admit(&beta, &gh, (rule, org), t0).unwrap().unwrap();
        assert_eq!(c.left(Direction::Up, t0), Some(1000));
        // Down is bounded on its own.
        assert_eq!(
            c.spend(Direction::Down, 500, t0),
            Some(Scope::Rule(gh.clone()))
        );
        let e = v.admit(&beta, &gh, (rule, org), t0).unwrap_err();
        assert_eq!(e.direction, Direction::Down);
        let state = v.state(t0);
        let rows: Vec<(&str, &str, u64, Option<u64>)> = state
            .iter()
            .map(|s| (s.org.as_str(), s.rule.as_str(), s.up.used, s.up.left))
            .collect();
        assert_eq!(
            rows,
            vec![
                ("acme", "*", 1500, Some(0)),
                ("acme", "gh", 900, Some(100)),
                ("acme", "pkg", 600, Some(400)),
                ("beta", "*", 0, Some(1500)),
                ("beta", "gh", 0, Some(1000)),
            ]
        );
        assert_eq!(state[1].down.limit, Some(500));
        assert_eq!(state[0].down.limit, None);
    }

    #[test]
    fn a_body_takes_what_is_left_and_is_told_which_budget_held_it_back() {
        let (acme, _, gh, _) = ids();
        let t0 = Instant::now();
        let v = Volumes::new(t0, MAX_METERS, None);
        let budgets = (Some(vol(Some(1000), None)), Some(vol(Some(800), None)));
        let lease = v.admit(&acme, &gh, budgets, t0).unwrap().unwrap();
        // Down is unbounded: all of it, charged (for the admin port).
        assert_eq!(lease.take(Direction::Down, 5000, t0, false), (5000, None));
        assert_eq!(lease.take(Direction::Up, 500, t0, false), (500, None));
        // The org's 800 bound first: 300 of 400 go.
        assert_eq!(
            lease.take(Direction::Up, 400, t0, false),
            (300, Some(Scope::Org))
        );
        assert_eq!(
            lease.take(Direction::Up, 1, t0, false),
            (0, Some(Scope::Org))
        );
        assert_eq!(lease.left(Direction::Up, t0), Some(0));
        // Report mode: everything goes, the budget it passed named.
        assert_eq!(
            lease.take(Direction::Up, 10, t0, true),
            (10, Some(Scope::Org))
        );
        let rows: Vec<(String, u64)> = v
            .state(t0)
            .into_iter()
            .map(|s| (s.rule, s.up.used))
            .collect();
        assert_eq!(rows, [("*".to_string(), 810), ("gh".to_string(), 810)]);
        assert!(v.admit(&acme, &gh, budgets, t0).is_err());
    }

    #[test]
    fn a_reload_keeps_what_a_rule_spent_and_a_new_window_frees_it_later() {
        let (acme, _, gh, _) = ids();
        let t0 = Instant::now();
        let v = Volumes::new(t0, MAX_METERS, None);
        let lease = v
            .admit(&acme, &gh, (Some(vol(Some(1000), None)), None), t0)
            .unwrap()
            .unwrap();
        lease.spend(Direction::Up, 1000, t0);
        drop(lease);
        // The same rule id under a larger limit: what was spent counts.
        let bigger = (Some(vol(Some(1500), None)), None);
        let l = v.admit(&acme, &gh, bigger, t0).unwrap().unwrap();
        assert_eq!(l.left(Direction::Up, t0), Some(500));
        drop(l);
        // A ten-second window: the 1000 bytes are kept, freed within
        // the new window (plus a slot).
        let short = Volume {
            up: Some(1000),
            down: None,
            window: Duration::from_secs(10),
        };
        let t1 = t0 + Duration::from_secs(5);
        assert!(v.admit(&acme, &gh, (Some(short), None), t1).is_err());
        let t2 = t1 + Duration::from_millis(10_200);
        assert!(v.admit(&acme, &gh, (Some(short), None), t2).is_ok());
    }

    #[test]
    fn the_table_is_bounded_and_refuses_when_full() {
        let t0 = Instant::now();
        let v = Volumes::new(t0, 2, None);
        let b = (Some(vol(Some(10), None)), None);
        let acme: Arc<str> = Arc::from("acme");
        let keep = v.admit(&acme, &Arc::from("r1"), b, t0).unwrap().unwrap();
        let spent = v.admit(&acme, &Arc::from("r2"), b, t0).unwrap().unwrap();
        spent.spend(Direction::Up, 1, t0);
        drop(spent);
        let e = v.admit(&acme, &Arc::from("r3"), b, t0).unwrap_err();
        assert_eq!(e.retry_after, None);
        assert!(e.detail().contains("table full"));
        // Once r2's window is empty and nothing holds it, it makes room.
        let later = t0 + Duration::from_secs(62);
        assert!(v.admit(&acme, &Arc::from("r3"), b, later).is_ok());
        drop(keep);
        assert_eq!(v.state(later).len(), 2);
    }

    #[test]
    fn refusals_and_cuts_are_counted_by_org_and_direction() {
        let counter =
            IntCounterVec::new(prometheus::Opts::new("t", "t"), &["org", "direction"]).unwrap();
        let (acme, _, gh, _) = ids();
        let t0 = Instant::now();
        let v = Volumes::new(t0, MAX_METERS, Some(counter.clone()));
        let b = (Some(vol(None, Some(5))), None);
        let l = v.admit(&acme, &gh, b, t0).unwrap().unwrap();
        l.spend(Direction::Down, 5, t0);
        assert!(v.admit(&acme, &gh, b, t0).is_err());
        v.count("acme", Direction::Down);
        assert_eq!(counter.with_label_values(&["acme", "down"]).get(), 2);
        assert_eq!(counter.with_label_values(&["acme", "up"]).get(), 0);
    }
}
