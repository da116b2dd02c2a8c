//! The endpoint table: one row per vLLM server the router may pick, with its latest metrics,
//! their age, its health, and the gateway's own accounting of what it sent there since.
//!
//! Rows keep a stable `slot` (a small integer) for their lifetime so the prefix index can
//! refer to endpoints compactly; a departed endpoint's slot is reused only after its index
//! entries were purged.

use crate::fleet::EnvoyHealth;
use crate::health::Health;
use crate::metrics::VllmMetrics;
use std::collections::{BTreeMap, BTreeSet};

use crate::seen::SeenShare;
use crate::speed::{self, Completions, PrefillPace, Speed, StepTime, TtftBias};
use crate::types::{EndpointId, Millis, Tokens};

pub type Slot = u16;

#[derive(Clone, Debug)]
pub struct Endpoint {
    pub id: EndpointId,
    pub slot: Slot,
    pub metrics: Option<VllmMetrics>,
    pub scraped_at: Option<Millis>,
    pub health: Health,
    /// Requests the gateway sent here that have not completed.
    pub inflight: u32,
    /// Requests and uncached prompt tokens sent since the last scrape: the load the
    /// metrics cannot show yet.
    pub sent_since_scrape: u32,
    pub sent_tokens_since_scrape: Tokens,
    /// Uncached prompt tokens of this gateway's requests here that have not produced a first
    /// token yet: prefill work the gateway knows is queued or running, whatever the scrape says.
    pub pending_prefill_tokens: Tokens,
    /// The same requests one by one, oldest first, by (routed at, request key). The first is
    /// the one the server is taken to be prefilling now.
    pub prefilling: BTreeMap<(Millis, u64), Prefill>,
    /// Those of them that are this router's own streams (`RouteRequest::first_token_timed`),
    /// oldest first: the tiers' floor reads the first one on every request, and a walk of
    /// `prefilling` to find it grows with peers' and whole responses' requests (64 servers
    /// with 512 each: route() 18 → 200 µs).
    timed_prefilling: BTreeSet<(Millis, u64)>,
    /// When the oldest of them last produced its first token here.
    pub front_done_at: Option<Millis>,
    /// How fast those first tokens came (see `speed::PrefillPace`).
    pub pace: PrefillPace,
    /// It has reported `prompt_tokens_details` (vLLM's `--enable-prompt-tokens-details`): from
    /// it, `usage` without details means nothing was cached.
    pub reports_cached: bool,
    /// What Envoy says of it (always `Serve` for a static pool).
    pub envoy: EnvoyHealth,
    /// Its priority in Envoy's pool cluster (0 for a static pool).
    pub priority: u32,
    /// Its load-balancing weight in Envoy's pool cluster (1 for a static pool; see
    /// `policy::speed_weight`).
    pub lb_weight: u32,
    /// The model ids its `/v1/models` lists, once read.
    pub models: Option<Vec<String>>,
    /// Its prefill rate as this router learned it (see `speed`).
    pub speed: Speed,
    /// Its recent step time from its metrics (see `speed::StepTime`).
    pub step: StepTime,
    /// How fast it finishes requests, from its metrics (see `speed::Completions`).
    pub completions: Completions,
    /// Observed ÷ predicted TTFT of this router's requests here (see `speed::TtftBias`).
    pub ttft_bias: TtftBias,
    /// Until when it counts as refusing work: a request sent here was served elsewhere
    /// (Envoy retried it after a 503 or a failed connection).
    pub refused_until: Option<Millis>,
    /// How much of its traffic went through this router and its peers (see `seen`).
    pub seen: SeenShare,
}

/// A request of this gateway's that has no first token yet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prefill {
    /// Its prompt tokens the router expects cached where it went.
    pub cached: Tokens,
    pub uncached: Tokens,
}

impl Endpoint {
    fn new(id: EndpointId, slot: Slot) -> Self {
        Self {
            id,
            slot,
            metrics: None,
            scraped_at: None,
            health: Health::default(),
            inflight: 0,
            sent_since_scrape: 0,
            sent_tokens_since_scrape: Tokens(0),
            pending_prefill_tokens: Tokens(0),
            prefilling: BTreeMap::new(),
            timed_prefilling: BTreeSet::new(),
            front_done_at: None,
            pace: PrefillPace::default(),
            reports_cached: false,
            envoy: EnvoyHealth::Serve,
            priority: 0,
            lb_weight: 1,
            models: None,
            speed: Speed::default(),
            step: StepTime::default(),
            completions: Completions::default(),
            ttft_bias: TtftBias::default(),
            refused_until: None,
            seen: SeenShare::default(),
        }
    }

    /// When the server could start on its oldest request still prefilling: that request's
    /// routing, or the previous oldest one's first token if that came later.
    pub fn front_started(&self) -> Option<Millis> {
        let ((routed_at, _), _) = self.prefilling.first_key_value()?;
        Some(self.front_done_at.map_or(*routed_at, |done| done.max(*routed_at)))
    }

    /// The prefill this gateway's requests here still need: `pending_prefill_tokens` less
    /// `credit` × the progress of the oldest since it could start, at the pace first tokens
    /// showed (never more than that request's own tokens; a token's cost grows with its
    /// position, `speed::prefill_work`). The plain pending count keeps a prompt's whole
    /// uncached length until its first token, so a server halfway through a long prompt reads
    /// as busy as one that has not begun. Full credit reads busy servers as
    /// free too early (the pace is an average; the replay measured more hits but slower
    /// TTFT), so the configured credit is a part of it (`cost.progress_credit`). With no pace
    /// known yet it is the pending count.
    pub fn prefill_left(&self, now: Millis, credit: f64, attention_tokens: f64) -> Tokens {
        let pending = self.pending_prefill_tokens;
        let (Some(per_ms), Some(started), Some((_, front))) = (
            self.pace.per_ms(now),
            self.front_started(),
            self.prefilling.first_key_value(),
        ) else {
            return pending;
        };
        let work = credit * per_ms * now.since(started) as f64;
        let progressed = speed::tokens_for_work(front.cached.0 as f64, work, attention_tokens);
        pending.saturating_sub(Tokens((progressed as u64).min(front.uncached.0)))
    }

    /// How long this router's oldest request here with a timed first token (a stream) has
    /// waited for it (0 when none waits). Not a peer's: its first token comes as an event
    /// that can be lost on the way (a lapped reader), and it would read as waiting until its
    /// completion or its expiry.
    pub fn oldest_pending_ms(&self, now: Millis) -> u64 {
        self.oldest_timed().map_or(0, |(routed_at, _)| now.since(routed_at))
    }

    /// This router's oldest stream here still without a first token: (routed at, key).
    pub fn oldest_timed(&self) -> Option<(Millis, u64)> {
        self.timed_prefilling.first().copied()
    }

    /// Request `(routed_at, key)`, waiting here for its first token, is this router's own
    /// stream (only a request in `prefilling` can be).
    pub fn mark_timed(&mut self, routed_at: Millis, key: u64) {
        if self.prefilling.contains_key(&(routed_at, key)) {
            self.timed_prefilling.insert((routed_at, key));
        }
    }

    /// Request `(routed_at, old)`, if waiting here, is now known as `new` (its router took
    /// a new origin: `Router::share_with_peers`).
    pub fn rekey_prefill(&mut self, routed_at: Millis, old: u64, new: u64) {
        if let Some(p) = self.prefilling.remove(&(routed_at, old)) {
            self.prefilling.insert((routed_at, new), p);
            if self.timed_prefilling.remove(&(routed_at, old)) {
                self.timed_prefilling.insert((routed_at, new));
            }
        }
    }

    /// Request `(routed_at, key)` no longer waits for its first token here.
    pub fn end_prefill(&mut self, routed_at: Millis, key: u64) {
        self.prefilling.remove(&(routed_at, key));
        self.timed_prefilling.remove(&(routed_at, key));
        debug_assert!(
            self.timed_prefilling.len() <= self.prefilling.len(),
            "a timed request must be one waiting for its first token"
        );
    }

    /// Whether it says it serves `model`: in `/v1/models`, as a base model in its metrics,
    /// or as a LoRA adapter it is running or about to run.
    pub fn lists_model(&self, model: &str) -> bool {
        let has = |list: &[String]| list.iter().any(|m| m == model);
        self.models.as_deref().is_some_and(has)
            || self
                .metrics
                .as_ref()
                .is_some_and(|m| has(&m.models) || m.lora.as_ref().is_some_and(|l| has(&l.running) || has(&l.waiting)))
    }

    /// Whether it says anything about its models (a server that does not cannot be
    /// filtered by model).
    pub fn knows_models(&self) -> bool {
        self.models.is_some() || self.metrics.as_ref().is_some_and(|m| !m.models.is_empty())
    }

    /// For a LoRA adapter `model`: whether it is loaded (running or waiting) here, and
    /// whether every adapter slot (`max_lora`) is taken by others.
    pub fn adapter_state(&self, model: &str) -> Option<(bool, bool)> {
        let m = self.metrics.as_ref()?;
        // No model named: the server's base model, never an adapter to load.
        if model.is_empty() || m.models.iter().any(|b| b == model) {
            return None;
        }
        let lora = m.lora.as_ref()?;
        let loaded = lora.running.iter().chain(&lora.waiting).any(|a| a == model);
        let mut active: Vec<&String> = lora.running.iter().chain(&lora.waiting).collect();
        active.sort();
        active.dedup();
        let full = lora.max_lora > 0 && active.len() >= lora.max_lora as usize;
        Some((loaded, full && !loaded))
    }

    /// It refused a request less than `overload.refused_ms` ago.
    pub fn refusing(&self, now: Millis) -> bool {
        self.refused_until.is_some_and(|until| now < until)
    }

    /// Metrics no older than `stale_after_ms`, if any.
    pub fn fresh_metrics(&self, now: Millis, stale_after_ms: u64) -> Option<&VllmMetrics> {
        let at = self.scraped_at?;
        (now.since(at) <= stale_after_ms)
            .then_some(self.metrics.as_ref())
            .flatten()
    }
}

/// Endpoints sorted by id, which is also the deterministic tie-break order.
#[derive(Clone, Debug, Default)]
pub struct EndpointTable {
    rows: Vec<Endpoint>,
    free_slots: Vec<Slot>,
    next_slot: Slot,
}

/// What changed when the membership was replaced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MembershipChange {
    pub added: Vec<EndpointId>,
    pub removed: Vec<(EndpointId, Slot)>,
}

impl EndpointTable {
    pub fn rows(&self) -> &[Endpoint] {
        &self.rows
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Every row, to change in place (a reference policy that sets the truth itself).
    pub fn rows_mut(&mut self) -> &mut [Endpoint] {
        &mut self.rows
    }

    pub fn get(&self, id: &EndpointId) -> Option<&Endpoint> {
        self.rows.binary_search_by(|e| e.id.cmp(id)).ok().map(|i| &self.rows[i])
    }

    pub fn get_mut(&mut self, id: &EndpointId) -> Option<&mut Endpoint> {
        self.rows
            .binary_search_by(|e| e.id.cmp(id))
            .ok()
            .map(|i| &mut self.rows[i])
    }

    /// Makes the membership exactly `ids` (duplicates ignored); keeps the state of endpoints
    /// that stay. At most `Slot::MAX` endpoints are kept; the rest are ignored.
    pub fn replace(&mut self, ids: &[EndpointId]) -> MembershipChange {
        let mut wanted: Vec<&EndpointId> = ids.iter().collect();
        wanted.sort();
        wanted.dedup();
        wanted.truncate(usize::from(Slot::MAX));
        let mut change = MembershipChange::default();
        let old = std::mem::take(&mut self.rows);
        for row in old {
            if wanted.binary_search(&&row.id).is_ok() {
                self.rows.push(row);
            } else {
                self.free_slots.push(row.slot);
                change.removed.push((row.id, row.slot));
            }
        }
        for id in wanted {
            if self.get(id).is_none() {
                let slot = self.free_slots.pop().unwrap_or_else(|| {
                    self.next_slot += 1;
                    self.next_slot - 1
                });
                self.rows.push(Endpoint::new(id.clone(), slot));
                self.rows.sort_by(|a, b| a.id.cmp(&b.id));
                change.added.push(id.clone());
            }
        }
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(names: &[&str]) -> Vec<EndpointId> {
        names.iter().map(|n| EndpointId::new(*n)).collect()
    }

    #[test]
    fn replace_keeps_state_of_staying_endpoints_and_reuses_freed_slots() {
        let mut t = EndpointTable::default();
        t.replace(&ids(&["b:1", "a:1"]));
        assert_eq!(
            t.rows().iter().map(|e| e.id.as_str()).collect::<Vec<_>>(),
            ["a:1", "b:1"]
        );
        t.get_mut(&EndpointId::new("a:1")).unwrap().inflight = 5;
        let freed = t.get(&EndpointId::new("b:1")).unwrap().slot;
        let change = t.replace(&ids(&["a:1", "c:1", "a:1"]));
        assert_eq!(change.removed, vec![(EndpointId::new("b:1"), freed)]);
        assert_eq!(change.added, ids(&["c:1"]));
        assert_eq!(t.get(&EndpointId::new("a:1")).unwrap().inflight, 5);
        assert_eq!(t.get(&EndpointId::new("c:1")).unwrap().slot, freed);
    }

    #[test]
    fn metrics_older_than_the_limit_are_not_fresh() {
        let mut t = EndpointTable::default();
        t.replace(&ids(&["a:1"]));
        let e = t.get_mut(&EndpointId::new("a:1")).unwrap();
        assert!(e.fresh_metrics(Millis(0), 100).is_none());
        e.metrics = Some(VllmMetrics::default());
        e.scraped_at = Some(Millis(1000));
        assert!(e.fresh_metrics(Millis(1100), 100).is_some());
        assert!(e.fresh_metrics(Millis(1101), 100).is_none());
    }
}
