//! Per-endpoint health: a small state machine fed by active scrapes and passive outcomes.
//!
//! Active: `unhealthy_after_failures` consecutive scrape failures mark an endpoint
//! unhealthy; `healthy_after_successes` consecutive successes bring it back. Passive:
//! `passive_failures_to_eject` consecutive failed responses (5xx, reset, connect failure)
//! eject it for `eject_ms`, whatever the scrapes say, since a server can serve `/metrics`
//! and still fail inference. A 503 is not a failure here: it is a full server refusing work
//! (`overload.refused_ms`). Transitions are reported so callers can log and count flips.

use crate::config::RawHealth;
use crate::types::Millis;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthState {
    /// Never scraped successfully yet.
    Unknown,
    Healthy,
    Unhealthy,
}

/// A state change worth logging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flip {
    BecameHealthy,
    BecameUnhealthy,
    Ejected { until: Millis },
}

#[derive(Clone, Debug)]
pub struct Health {
    state: HealthState,
    failures: u32,
    successes: u32,
    passive_failures: u32,
    ejected_until: Option<Millis>,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            state: HealthState::Unknown,
            failures: 0,
            successes: 0,
            passive_failures: 0,
            ejected_until: None,
        }
    }
}

impl Health {
    pub fn state(&self) -> HealthState {
        self.state
    }

    pub fn is_ejected(&self, now: Millis) -> bool {
        self.ejected_until.is_some_and(|until| now < until)
    }

    /// Not known bad: unknown or healthy, and not ejected.
    pub fn may_serve(&self, now: Millis) -> bool {
        self.state != HealthState::Unhealthy && !self.is_ejected(now)
    }

    pub fn on_scrape_ok(&mut self, cfg: &RawHealth) -> Option<Flip> {
        self.failures = 0;
        self.successes = self.successes.saturating_add(1);
        let recover = self.state == HealthState::Unknown
            || (self.state == HealthState::Unhealthy && self.successes >= cfg.healthy_after_successes);
        recover.then(|| {
            self.state = HealthState::Healthy;
            Flip::BecameHealthy
        })
    }

    pub fn on_scrape_failed(&mut self, cfg: &RawHealth) -> Option<Flip> {
        self.successes = 0;
        self.failures = self.failures.saturating_add(1);
        (self.state != HealthState::Unhealthy && self.failures >= cfg.unhealthy_after_failures).then(|| {
            self.state = HealthState::Unhealthy;
            Flip::BecameUnhealthy
        })
    }

    /// Adopts a verdict reached elsewhere (the filter's scraping service decides active
    /// health; worker VMs apply its verdict from the shared snapshot).
    pub fn set_active(&mut self, healthy: bool) -> Option<Flip> {
        let target = if healthy {
            HealthState::Healthy
        } else {
            HealthState::Unhealthy
        };
        if self.state == target {
            return None;
        }
        self.state = target;
        Some(if healthy {
            Flip::BecameHealthy
        } else {
            Flip::BecameUnhealthy
        })
    }

    /// A response outcome seen on the data path.
    pub fn on_response(&mut self, ok: bool, now: Millis, cfg: &RawHealth) -> Option<Flip> {
        if ok {
            self.passive_failures = 0;
            return None;
        }
        self.passive_failures = self.passive_failures.saturating_add(1);
        if self.passive_failures < cfg.passive_failures_to_eject || self.is_ejected(now) {
            return None;
        }
        self.passive_failures = 0;
        let until = now.plus(cfg.eject_ms);
        self.ejected_until = Some(until);
        Some(Flip::Ejected { until })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> RawHealth {
        RawHealth {
            unhealthy_after_failures: 2,
            healthy_after_successes: 2,
            passive_failures_to_eject: 3,
            eject_ms: 1000,
            stale_after_ms: 1000,
        }
    }

    #[test]
    fn first_success_makes_an_unknown_endpoint_healthy() {
        let mut h = Health::default();
        assert_eq!(h.on_scrape_ok(&cfg()), Some(Flip::BecameHealthy));
        assert_eq!(h.on_scrape_ok(&cfg()), None);
    }

    #[test]
    fn consecutive_failures_flip_once_and_recovery_needs_consecutive_successes() {
        let c = cfg();
        let mut h = Health::default();
        h.on_scrape_ok(&c);
        assert_eq!(h.on_scrape_failed(&c), None);
        assert_eq!(h.on_scrape_failed(&c), Some(Flip::BecameUnhealthy));
        assert_eq!(h.on_scrape_failed(&c), None, "reports the flip only once");
        assert_eq!(h.on_scrape_ok(&c), None);
        h.on_scrape_failed(&c);
        assert_eq!(h.on_scrape_ok(&c), None, "a failure in between resets the count");
        assert_eq!(h.on_scrape_ok(&c), Some(Flip::BecameHealthy));
    }

    #[test]
    fn passive_failures_eject_for_a_while_then_release() {
        let c = cfg();
        let mut h = Health::default();
        h.on_scrape_ok(&c);
        assert_eq!(h.on_response(false, Millis(0), &c), None);
        assert_eq!(h.on_response(true, Millis(0), &c), None, "a success resets the streak");
        h.on_response(false, Millis(10), &c);
        h.on_response(false, Millis(10), &c);
        assert_eq!(
            h.on_response(false, Millis(10), &c),
            Some(Flip::Ejected { until: Millis(1010) })
        );
        assert!(!h.may_serve(Millis(500)));
        assert!(h.may_serve(Millis(1010)));
    }
}
