//! The endpoint table: one row per vLLM server the router may pick, with its latest metrics,
//! their age, its health, and the gateway's own accounting of what it sent there since.
//!
//! Rows keep a stable `slot` (a small integer) for their lifetime so the prefix index can
//! refer to endpoints compactly; a departed endpoint's slot is reused only after its index
//! entries were purged.

use crate::fleet::EnvoyHealth;
use crate::health::Health;
use crate::metrics::VllmMetrics;
use crate::speed::{Speed, TtftBias};
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
    /// It has reported `prompt_tokens_details` (vLLM's `--enable-prompt-tokens-details`): from
    /// it, `usage` without details means nothing was cached.
    pub reports_cached: bool,
    /// What Envoy says of it (always `Serve` for a static pool).
    pub envoy: EnvoyHealth,
    /// Its priority in Envoy's pool cluster (0 for a static pool).
    pub priority: u32,
    /// The model ids its `/v1/models` lists, once read.
    pub models: Option<Vec<String>>,
    /// Its prefill rate as this router learned it (see `speed`).
    pub speed: Speed,
    /// Observed ÷ predicted TTFT of this router's requests here (see `speed::TtftBias`).
    pub ttft_bias: TtftBias,
    /// Until when it counts as refusing work: a request sent here was served elsewhere
    /// (Envoy retried it after a 503 or a failed connection).
    pub refused_until: Option<Millis>,
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
            reports_cached: false,
            envoy: EnvoyHealth::Serve,
            priority: 0,
            models: None,
            speed: Speed::default(),
            ttft_bias: TtftBias::default(),
            refused_until: None,
        }
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
        if m.models.iter().any(|b| b == model) {
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
