//! The worker side of one view per process: when a worker exchanges with its peers
//! (`mesh`), and what it does with what arrives.
//!
//! A worker exchanges on every tick (`share.tick_ms`, 2 ms by default) while anything moves,
//! and with `share.on_request` (the default) also around each routing decision: it applies
//! its peers' new placements just before scoring and publishes its own just after, so a
//! decision lags the others' by microseconds instead of up to two ticks (replay: the lag is
//! what separates W workers' TTFT p95 from one router's). With `share.hits_on_tick` a busy
//! worker leaves its prefix hits for the tick (`publish_at_once`). That costs host calls on the
//! request path (measured in BENCHMARKS.md); the tick still carries first tokens and
//! completions.
//! After `IDLE_AFTER_MS` with nothing published or received it slows its tick to
//! `IDLE_TICK_MS`, so an idle gateway does not wake every worker 500 times a second; the
//! first request it then routes catches up inline (one exchange) before it is scored, and
//! the fast tick resumes.

use std::cell::{Cell, RefCell};

use kvroute_core::{Config, Millis, PeerEvent, Router};
use proxy_wasm::types::LogLevel;

use crate::host;
use crate::mesh::{Mesh, Published, Segment};
use crate::replicas::{DirectSender, NotSent};
use crate::stats::{self_clock, RequestStats};

const IDLE_AFTER_MS: u64 = 1000;
/// A peer's request still in flight after this long lost its completion on the way (it is
/// released; a generation really that long is then under-counted on the other workers).
const PEER_REQUEST_MAX_MS: u64 = 600_000;
const IDLE_TICK_MS: u64 = 50;

pub struct Peers {
    /// `None` when this worker does not share (switched off, or it could not join).
    mesh: RefCell<Option<Mesh>>,
    tick_ms: u64,
    /// `share.on_request`: also exchange around each routing decision.
    on_request: bool,
    /// `share.hits_on_tick`: after a decision, publish at once only news, or anything when
    /// this worker has published nothing for over two ticks (`publish_at_once`).
    hits_on_tick: bool,
    /// When this worker last published events (ms).
    last_push: Cell<u64>,
    idle: Cell<bool>,
    last_activity: Cell<u64>,
    /// When this worker last read its peers' segments.
    last_pull: Cell<u64>,
    members: Cell<u64>,
    /// `share.replicas.from_workers`: this worker POSTs its placements that are news to the
    /// other replicas itself.
    direct: Option<DirectSender>,
}

thread_local! {
    /// Set by the scraping service's root. Envoy also runs the HTTP filter's root context on
    /// its main thread (thread-local plugins exist on every thread), in the VM the service
    /// shares when both have the same `vm_id` and code: that root never sees a request, so it
    /// must not be a mesh member reading every segment (it was: a third of the applied
    /// events at 2 workers).
    static SERVICE_IN_THIS_VM: Cell<bool> = const { Cell::new(false) };
}

/// The scraping service started in this VM (so this VM lives on Envoy's main thread).
pub fn service_started_here() {
    SERVICE_IN_THIS_VM.with(|s| s.set(true));
}

fn on_main_thread() -> bool {
    SERVICE_IN_THIS_VM.with(Cell::get)
}

impl Peers {
    /// Joins the process's mesh when `share.workers` is on, and stamps `router` with the
    /// origin it got.
    pub fn join(router: &mut Router) -> Peers {
        let config: &Config = router.config();
        let share = config.share().clone();
        let scrape_interval_ms = config.scrape().interval_ms;
        let direct = DirectSender::new(config);
        let mesh = (share.workers && !on_main_thread()).then(Mesh::join).flatten();
        match &mesh {
            None if share.workers && on_main_thread() => {}
            Some(m) => router.share_with_peers(m.origin()),
            None if share.workers => host::log(
                LogLevel::Warn,
                "this worker cannot join the shared view (shared data refused or too many workers); it routes on its own",
            ),
            None => {}
        }
        let tick_ms = if mesh.is_some() {
            share.tick_ms
        } else {
            (scrape_interval_ms / 2).clamp(10, 1000)
        };
        Peers {
            mesh: RefCell::new(mesh),
            tick_ms,
            on_request: share.on_request,
            hits_on_tick: share.hits_on_tick,
            last_push: Cell::new(0),
            idle: Cell::new(false),
            last_activity: Cell::new(0),
            last_pull: Cell::new(0),
            members: Cell::new(0),
            direct,
        }
    }

    /// Leaves the mesh when this root turns out to sit on Envoy's main thread (see
    /// `on_main_thread`), in case it joined before the scraping service started there.
    fn leave_if_main_thread(&self) {
        if !on_main_thread() {
            return;
        }
        if let Ok(mut mesh) = self.mesh.try_borrow_mut() {
            if mesh.take().is_some() {
                host::log(
                    LogLevel::Info,
                    "the filter's root on the main thread routes nothing: it left the shared view",
                );
            }
        }
    }

    /// The worker's tick period to start with.
    pub fn tick_ms(&self) -> u64 {
        self.tick_ms
    }

    /// The tick never slower than `ms` when awake (holding: a held request waits for it).
    pub fn cap_tick_ms(&mut self, ms: u64) {
        self.tick_ms = self.tick_ms.min(ms.max(1));
    }

    /// Keeps the fast tick while this worker needs it (it holds requests), even when its
    /// peers are quiet.
    pub fn stay_awake(&self, now: Millis) {
        self.last_activity.set(now.0);
        if self.idle.get() && host::set_tick_period_ms(self.tick_ms).is_ok() {
            self.idle.set(false);
        }
    }

    /// Applies what the peers published, even when this worker read them within this
    /// millisecond: before releasing a held request, whose room another worker's release
    /// may have just taken.
    pub fn pull_now(&self, router: &mut Router, stats: &RequestStats, now: Millis) {
        self.pull(router, stats, now);
    }

    pub fn on_tick(&self, router: &mut Router, stats: &RequestStats, now: Millis) {
        self.leave_if_main_thread();
        let t0 = self_clock();
        // With `share.on_request`, a worker under traffic already read the log within the
        // tick: the tick then only publishes what completions and first tokens left.
        let pulled_lately = self.on_request && now.0.saturating_sub(self.last_pull.get()) < self.tick_ms;
        let moved = if pulled_lately {
            self.push(router, stats, now);
            true
        } else {
            self.exchange(router, stats, now)
        };
        stats.share_ns[2].add(self_clock().saturating_sub(t0));
        if moved {
            self.last_activity.set(now.0);
            // Peers are busy again: read at the fast tick, not 256 segments per 50 ms.
            if self.idle.get() && host::set_tick_period_ms(self.tick_ms).is_ok() {
                self.idle.set(false);
            }
        } else if !self.idle.get()
            && now.0.saturating_sub(self.last_activity.get()) > IDLE_AFTER_MS
            && host::set_tick_period_ms(IDLE_TICK_MS).is_ok()
        {
            self.idle.set(true);
        }
    }

    /// Before scoring a request: with `share.on_request`, apply what the peers published
    /// since (so the decision sees their latest placements, not those of the last tick),
    /// at most once per millisecond: a busy worker's later decisions in the same
    /// millisecond route with what it read for the first. That halves the reads of the
    /// log's head where they cost most (wrk, 1 KiB: the mesh's work in the VMs 3.1 → 1.8 µs a
    /// request at 2 workers, 10.6 → 8.4 at 8), and replay at 80% load cannot tell the
    /// difference (a worker rarely routes twice in a millisecond there: BENCHMARKS.md). A
    /// worker whose tick slowed down catches up and speeds it up again.
    pub fn before_route(&self, router: &mut Router, stats: &RequestStats, now: Millis) {
        let idle = self.idle.get();
        let t0 = self_clock();
        let pulled_this_ms = self.last_pull.get() == now.0 && now.0 > 0;
        if (self.on_request && !pulled_this_ms) || idle {
            self.pull(router, stats, now);
        }
        if !idle {
            stats.share_ns[0].add(self_clock().saturating_sub(t0));
            return;
        }
        self.push(router, stats, now);
        stats.share_ns[0].add(self_clock().saturating_sub(t0));
        self.last_activity.set(now.0);
        if host::set_tick_period_ms(self.tick_ms).is_ok() {
            self.idle.set(false);
        }
    }

    /// After a request was routed: with `share.on_request`, publish the placement at once.
    /// With `hits_on_tick` a prefix hit waits for the tick only while this worker published
    /// lately (`publish_at_once`): `hits_on_tick` is a rate limit (at most about one segment per
    /// worker per tick for the peers to read, which is what sharing costs under load), not a
    /// delay. A quiet worker's hit leaves at once, so the scraping service can forward it to
    /// the other replicas at once (replay, 8 replicas × 16 workers at 80% load, multi-turn
    /// TTFT p95: 33.3 ms when hits always waited for the tick, 30.7 with this, one router
    /// 28.4).
    pub fn after_route(&self, router: &mut Router, stats: &RequestStats, now: Millis) {
        if self.on_request
            && publish_at_once(
                self.hits_on_tick,
                router.peer_news_waiting(),
                now.0.saturating_sub(self.last_push.get()),
                self.tick_ms,
            )
        {
            let t0 = self_clock();
            self.push(router, stats, now);
            stats.share_ns[1].add(self_clock().saturating_sub(t0));
        }
    }

    /// Publishes what this worker did at once, whatever `share.on_request` says: a held
    /// request's release, which the owner of the next held one must see before it routes.
    pub fn publish_now(&self, router: &mut Router, stats: &RequestStats, now: Millis) {
        self.push(router, stats, now);
    }

    /// Publishes this worker's changes and applies its peers'. Returns whether anything moved.
    fn exchange(&self, router: &mut Router, stats: &RequestStats, now: Millis) -> bool {
        let pushed = self.push(router, stats, now);
        let pulled = self.pull(router, stats, now);
        pushed || pulled
    }

    /// Publishes what this worker did since it last published.
    fn push(&self, router: &mut Router, stats: &RequestStats, now: Millis) -> bool {
        let Ok(mut guard) = self.mesh.try_borrow_mut() else {
            return false;
        };
        let Some(mesh) = guard.as_mut() else { return false };
        let out = router.take_peer_events();
        let count = out.len() as u64;
        // Only news leaves from the worker itself: a prefix hit goes where the other
        // replicas already send that prefix, and can wait for the service's batch.
        let direct = self
            .direct
            .as_ref()
            .filter(|_| out.iter().any(PeerEvent::is_news))
            .map(|d| d.ready(now).map(|to| (d, to)));
        let over_budget = matches!(direct, Some(Err(NotSent::OverBudget)));
        let send = direct
            .as_ref()
            .and_then(|r| r.as_ref().ok())
            .map(|(d, to)| |segment: &Segment| d.post(to, segment, stats));
        match mesh.publish(&out, now, send) {
            Published::Written if count > 0 => {
                stats.peer_events_published.add(count);
                // Counted once written: a refused write is tried again, and counted then.
                if over_budget {
                    stats.direct_over_budget.inc();
                }
            }
            Published::Written | Published::NotDue => {}
            // Kept for the next push: a completion peers never hear of pins its load in
            // their views for `PEER_REQUEST_MAX_MS`.
            Published::NotReserved | Published::NotWritten => {
                let dropped = router.return_peer_events(out);
                if dropped > 0 {
                    stats.peer_events_unpublished.add(dropped as u64);
                }
                return false;
            }
        }
        if count > 0 {
            self.last_push.set(now.0);
        }
        count > 0
    }

    /// Applies what the peers published since this worker last looked.
    fn pull(&self, router: &mut Router, stats: &RequestStats, now: Millis) -> bool {
        let Ok(mut guard) = self.mesh.try_borrow_mut() else {
            return false;
        };
        let Some(mesh) = guard.as_mut() else { return false };
        self.last_pull.set(now.0);
        let rx = mesh.receive(now, router.config().share().peer_timeout_ms);
        let t0 = self_clock();
        let mut replaced = rx.replaced.iter().peekable();
        for (i, event) in rx.events.iter().enumerate() {
            // A known origin now written by a new VM: what the old one had in flight goes,
            // once the old one's last events are applied.
            while let Some((_, origin)) = replaced.next_if(|(at, _)| *at == i) {
                router.forget_peer(*origin);
            }
            router.on_peer_event(event, now);
        }
        for (_, origin) in replaced {
            router.forget_peer(*origin);
        }
        stats.share_ns[3].add(self_clock().saturating_sub(t0));
        if let Some(origin) = rx.new_origin {
            host::log(
                LogLevel::Warn,
                &format!("another worker used this worker's mesh origin; now {origin}"),
            );
            router.share_with_peers(origin);
        }
        for origin in &rx.gone {
            router.forget_peer(*origin);
            host::log(
                LogLevel::Info,
                &format!("worker {origin} left the shared view; its load is released"),
            );
        }
        if rx.members > 0 {
            // Once a heartbeat period: peers' requests whose completion never came.
            router.expire_peer_requests(now, PEER_REQUEST_MAX_MS);
        }
        if rx.members > 0 && rx.members != self.members.get() {
            // Each worker keeps a full copy of the index: the configured budget is split.
            self.members.set(rx.members);
            let budget = router.config().index().max_memory_bytes / rx.members as usize;
            router.set_index_budget(budget);
        }
        stats.peer_events.add(rx.events.len() as u64);
        stats.peer_events_lost.add(rx.lost);
        stats.peers_gone.add(rx.gone.len() as u64);
        !rx.events.is_empty()
    }
}

/// Whether a decision publishes what waits at once (with `share.on_request`): always
/// without `hits_on_tick`; with it, news, or anything when this worker has published
/// nothing for over two ticks. Two, on the millisecond clock: a worker whose tick publishes
/// every period (Envoy fires it late under load) must not read as quiet, or busy workers
/// write a segment per decision again (measured: one tick cost 1 µs a request at 8 workers,
/// two cost nothing).
fn publish_at_once(hits_on_tick: bool, news: bool, since_last_push_ms: u64, tick_ms: u64) -> bool {
    !hits_on_tick || news || since_last_push_ms > 2 * tick_ms
}

#[cfg(test)]
mod tests {
    use super::publish_at_once;

    #[test]
    fn a_hit_waits_for_the_tick_only_while_the_worker_published_lately() {
        assert!(publish_at_once(true, true, 0, 2), "news leaves at once");
        assert!(!publish_at_once(true, false, 0, 2), "a busy worker's hit waits");
        assert!(!publish_at_once(true, false, 4, 2), "two ticks ago is still busy");
        assert!(
            publish_at_once(true, false, 5, 2),
            "a quiet worker's hit leaves at once"
        );
        assert!(
            publish_at_once(false, false, 0, 2),
            "without hits_on_tick, everything at once"
        );
    }
}
