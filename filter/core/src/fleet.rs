//! The fleet as one value: who is in the pool, what Envoy says of each host, what the last
//! scrape said, and which models each serves. The scraping side (the singleton service, or
//! the worker holding the lease) keeps a [`Fleet`] and publishes its [`FleetState`]; every
//! router applies that state with one event, `Router::on_fleet`.
//!
//! Membership comes from Envoy (`discovery`, the admin `/clusters` view of the pool cluster)
//! or from the static `endpoints` list. Active health is the scrape state machine in
//! `health`, kept here once instead of in every router.

use serde::{Deserialize, Serialize};

use crate::config::RawHealth;
use crate::endpoint::MembershipChange;
use crate::health::{Flip, Health, HealthState};
use crate::metrics::VllmMetrics;
use crate::types::{EndpointId, Millis};

/// What Envoy says of a host, reduced to what routing does with it.
/// Ordered from most to least usable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum EnvoyHealth {
    /// Healthy or unknown to Envoy: may get new requests.
    #[default]
    Serve,
    /// Degraded (EDS or an active degraded check): only when nothing else is left.
    Degraded,
    /// Draining or pending removal: no new requests, in-flight ones finish.
    Draining,
    /// Failing Envoy's active health check, ejected by outlier detection, or unhealthy in
    /// EDS: no requests.
    Excluded,
}

impl EnvoyHealth {
    pub fn label(self) -> &'static str {
        match self {
            EnvoyHealth::Serve => "serve",
            EnvoyHealth::Degraded => "degraded",
            EnvoyHealth::Draining => "draining",
            EnvoyHealth::Excluded => "excluded",
        }
    }
}

/// One host of the pool as discovery reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    pub id: EndpointId,
    pub envoy: EnvoyHealth,
    /// Its priority in the cluster (EDS `priority`; 0 the highest and Envoy's default).
    pub priority: u32,
    /// Its load-balancing weight in the cluster (EDS `load_balancing_weight`; 1 by default).
    pub weight: u32,
}

/// One member of the published fleet state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Member {
    pub id: EndpointId,
    pub envoy: EnvoyHealth,
    /// Its priority in Envoy's pool cluster (`tiers.from_priority`).
    pub priority: u32,
    /// Its load-balancing weight there (`cost.speed_weights_from_envoy`).
    pub weight: u32,
    /// The scrape verdict: false once `unhealthy_after_failures` scrapes failed in a row
    /// (never scraped yet counts as true).
    pub scrape_healthy: bool,
    pub scraped_at: Option<Millis>,
    pub metrics: Option<VllmMetrics>,
    /// The model ids `/v1/models` lists (base models and LoRA adapters), once read.
    pub models: Option<Vec<String>>,
}

/// What the scraping side publishes and every router applies.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetState {
    pub version: u64,
    pub published_at: Millis,
    /// Sorted by id.
    pub members: Vec<Member>,
}

#[derive(Clone, Debug)]
struct Row {
    member: Member,
    health: Health,
    /// When `/v1/models` was last asked (answered or not).
    models_asked_at: Option<Millis>,
}

/// The scraping side's fleet: membership, Envoy health, scrape health, metrics and models.
#[derive(Clone, Debug)]
pub struct Fleet {
    health: RawHealth,
    rows: Vec<Row>,
    version: u64,
}

impl Fleet {
    pub fn new(health: RawHealth) -> Fleet {
        Fleet {
            health,
            rows: Vec::new(),
            version: 0,
        }
    }

    pub fn ids(&self) -> impl Iterator<Item = &EndpointId> {
        self.rows.iter().map(|r| &r.member.id)
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Hosts that may get new requests (Envoy serves them and the scrapes say healthy).
    pub fn routable(&self) -> usize {
        self.rows
            .iter()
            .filter(|r| {
                matches!(r.member.envoy, EnvoyHealth::Serve | EnvoyHealth::Degraded)
                    && r.member.scrape_healthy
                    && r.member.metrics.is_some()
            })
            .count()
    }

    /// The pool is now exactly `hosts` (an address listed twice counts once, as its most
    /// usable entry); members that stay keep their scrape state, new ones start unknown,
    /// departed ones are forgotten.
    pub fn on_hosts(&mut self, hosts: &[Host]) -> MembershipChange {
        let mut wanted: Vec<&Host> = hosts.iter().collect();
        wanted.sort_by(|a, b| a.id.cmp(&b.id).then(a.envoy.cmp(&b.envoy)));
        wanted.dedup_by(|later, earlier| later.id == earlier.id);
        let mut change = MembershipChange::default();
        let mut old = std::mem::take(&mut self.rows).into_iter().peekable();
        for host in wanted {
            while let Some(gone) = old.next_if(|r| r.member.id < host.id) {
                change.removed.push((gone.member.id, 0));
            }
            match old.next_if(|r| r.member.id == host.id) {
                Some(mut row) => {
                    row.member.envoy = host.envoy;
                    row.member.priority = host.priority;
                    row.member.weight = host.weight;
                    self.rows.push(row);
                }
                None => {
                    change.added.push(host.id.clone());
                    self.rows.push(Row {
                        member: Member {
                            id: host.id.clone(),
                            envoy: host.envoy,
                            priority: host.priority,
                            weight: host.weight,
                            scrape_healthy: true,
                            scraped_at: None,
                            metrics: None,
                            models: None,
                        },
                        health: Health::default(),
                        models_asked_at: None,
                    });
                }
            }
        }
        change.removed.extend(old.map(|r| (r.member.id, 0)));
        change
    }

    fn row(&mut self, id: &EndpointId) -> Option<&mut Row> {
        let i = self.rows.binary_search_by(|r| r.member.id.cmp(id)).ok()?;
        self.rows.get_mut(i)
    }

    pub fn on_metrics(&mut self, id: &EndpointId, metrics: VllmMetrics, now: Millis) -> Option<Flip> {
        let cfg = self.health.clone();
        let row = self.row(id)?;
        row.member.metrics = Some(metrics);
        row.member.scraped_at = Some(now);
        let flip = row.health.on_scrape_ok(&cfg);
        row.member.scrape_healthy = row.health.state() != HealthState::Unhealthy;
        flip
    }

    pub fn on_scrape_failed(&mut self, id: &EndpointId) -> Option<Flip> {
        let cfg = self.health.clone();
        let row = self.row(id)?;
        let flip = row.health.on_scrape_failed(&cfg);
        row.member.scrape_healthy = row.health.state() != HealthState::Unhealthy;
        flip
    }

    /// Members whose `/v1/models` is due: never asked, or asked `every_ms` ago or more.
    pub fn models_due(&self, now: Millis, every_ms: u64) -> Vec<EndpointId> {
        self.rows
            .iter()
            .filter(|r| r.models_asked_at.is_none_or(|t| now.since(t) >= every_ms))
            .map(|r| r.member.id.clone())
            .collect()
    }

    pub fn on_models_asked(&mut self, id: &EndpointId, now: Millis) {
        if let Some(row) = self.row(id) {
            row.models_asked_at = Some(now);
        }
    }

    pub fn on_models(&mut self, id: &EndpointId, models: Vec<String>) {
        if let Some(row) = self.row(id) {
            row.member.models = Some(models);
        }
    }

    /// Continues from a state published earlier (by a predecessor holding the lease):
    /// its members, verdicts, metrics and models, and versions after `version`.
    pub fn resume(&mut self, state: FleetState, version: u64) {
        self.version = self.version.max(version).max(state.version);
        self.rows = state
            .members
            .into_iter()
            .map(|member| {
                let mut health = Health::default();
                if member.scraped_at.is_some() || !member.scrape_healthy {
                    health.set_active(member.scrape_healthy);
                }
                Row {
                    member,
                    health,
                    models_asked_at: None,
                }
            })
            .collect();
        self.rows.sort_by(|a, b| a.member.id.cmp(&b.member.id));
        self.rows.dedup_by(|a, b| a.member.id == b.member.id);
    }

    /// The state to publish, as a new version.
    pub fn publish(&mut self, now: Millis) -> FleetState {
        self.version += 1;
        FleetState {
            version: self.version,
            published_at: now,
            members: self.rows.iter().map(|r| r.member.clone()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(id: &str, envoy: EnvoyHealth) -> Host {
        Host {
            id: EndpointId::new(id),
            envoy,
            priority: 0,
            weight: 1,
        }
    }

    fn health() -> RawHealth {
        RawHealth {
            unhealthy_after_failures: 2,
            ..RawHealth::default()
        }
    }

    #[test]
    fn membership_follows_the_hosts_and_keeps_the_state_of_those_that_stay() {
        let mut f = Fleet::new(health());
        let change = f.on_hosts(&[host("b:1", EnvoyHealth::Serve), host("a:1", EnvoyHealth::Serve)]);
        assert_eq!(change.added, vec![EndpointId::new("a:1"), EndpointId::new("b:1")]);
        f.on_metrics(&EndpointId::new("a:1"), VllmMetrics::default(), Millis(5));
        let change = f.on_hosts(&[host("a:1", EnvoyHealth::Draining), host("c:1", EnvoyHealth::Serve)]);
        assert_eq!(change.added, vec![EndpointId::new("c:1")]);
        assert_eq!(change.removed, vec![(EndpointId::new("b:1"), 0)]);
        let state = f.publish(Millis(9));
        assert_eq!(state.version, 1);
        let a = &state.members[0];
        assert_eq!(
            (a.id.as_str(), a.envoy, a.scraped_at),
            ("a:1", EnvoyHealth::Draining, Some(Millis(5)))
        );
        assert_eq!(state.members[1].id.as_str(), "c:1");
        assert!(state.members[1].metrics.is_none());
    }

    #[test]
    fn scrape_failures_flip_the_published_verdict() {
        let mut f = Fleet::new(health());
        f.on_hosts(&[host("a:1", EnvoyHealth::Serve)]);
        let a = EndpointId::new("a:1");
        f.on_metrics(&a, VllmMetrics::default(), Millis(1));
        assert_eq!(f.routable(), 1);
        assert_eq!(f.on_scrape_failed(&a), None);
        assert_eq!(f.on_scrape_failed(&a), Some(Flip::BecameUnhealthy));
        assert!(!f.publish(Millis(2)).members[0].scrape_healthy);
        assert_eq!(f.routable(), 0);
    }

    #[test]
    fn a_successor_resumes_the_published_state_and_its_versions() {
        let mut f = Fleet::new(health());
        f.on_hosts(&[host("a:1", EnvoyHealth::Serve), host("b:1", EnvoyHealth::Serve)]);
        f.on_metrics(&EndpointId::new("a:1"), VllmMetrics::default(), Millis(1));
        f.on_scrape_failed(&EndpointId::new("b:1"));
        f.on_scrape_failed(&EndpointId::new("b:1"));
        let state = f.publish(Millis(2));
        let mut next = Fleet::new(health());
        next.resume(state.clone(), 7);
        let resumed = next.publish(Millis(3));
        assert_eq!(resumed.version, 8);
        assert_eq!(resumed.members, state.members);
        assert_eq!(
            next.on_scrape_failed(&EndpointId::new("b:1")),
            None,
            "still unhealthy, no new flip"
        );
    }

    #[test]
    fn models_are_asked_once_then_every_interval() {
        let mut f = Fleet::new(health());
        f.on_hosts(&[host("a:1", EnvoyHealth::Serve)]);
        let a = EndpointId::new("a:1");
        assert_eq!(f.models_due(Millis(0), 1000), vec![a.clone()]);
        f.on_models_asked(&a, Millis(0));
        assert!(f.models_due(Millis(999), 1000).is_empty());
        assert_eq!(f.models_due(Millis(1000), 1000), vec![a.clone()]);
        f.on_models(&a, vec!["m".into()]);
        assert_eq!(f.publish(Millis(0)).members[0].models, Some(vec!["m".to_string()]));
    }
}
