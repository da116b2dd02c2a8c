//! The virtual-time driver: a fleet of engines, one policy, one workload, deterministic.
//!
//! Events (arrivals, step ends, scrape ticks) are ordered by time in microseconds, then by
//! sequence number, so a run with the same inputs is byte-for-byte repeatable. At each
//! scrape tick every server's `/metrics` body is rendered and parsed (as a gateway would),
//! and the policy sees only those snapshots, as stale as the interval makes them.
//!
//! The policy runs as one router or as a gateway topology (`topology`: replicas × workers,
//! each an independent router; see `replay::topology`).

use kvroute_core::request::{parse, ApiKind};
use kvroute_core::Config;

use crate::policies::PolicyName;
use crate::profile::Profile;
use crate::report::{Record, RunReport};
use crate::tokens::engine_blocks;
use crate::workload::SimRequest;

pub use classes::Classes;
pub use topology::Topology;

#[derive(Clone, Debug)]
pub struct ReplaySetup {
    /// The servers' profile (the first server's, for a mixed fleet).
    pub profile: Profile,
    pub servers: usize,
    /// A mixed fleet: server `i` runs `mixed[i]` (empty: every server runs `profile`).
    pub mixed: Vec<Profile>,
    /// One server slows down mid-run.
    pub slowdown: Option<Slowdown>,
    pub scrape_interval_ms: f64,
    pub seed: u64,
    pub router_config: Config,
    pub topology: Topology,
    /// Tenants and priority bands (overload runs); none: every request is priority 0 of
    /// tenant 0.
    pub classes: Option<Classes>,
    /// Servers that join or leave the pool mid-run (`check_pool_changes`).
    pub pool_changes: Vec<PoolChange>,
}

/// Server `server` joins the pool at `at_ms` (it is out of it before: no router knows it,
/// nothing scrapes it), or leaves it (from then on no router sends it anything and nothing
/// scrapes it; what it is running finishes, as a terminating pod drains). Every router
/// learns of it at once, as from its discovery.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolChange {
    pub server: usize,
    pub at_ms: f64,
    pub joins: bool,
}

/// Pool changes name servers of the fleet, each at most once, and leave one server in the
/// pool throughout.
pub fn check_pool_changes(servers: usize, changes: &[PoolChange]) -> anyhow::Result<()> {
    for (k, c) in changes.iter().enumerate() {
        anyhow::ensure!(
            c.server < servers,
            "server {} joins or leaves, but the fleet has {servers} servers, 0 to {}",
            c.server,
            servers.saturating_sub(1)
        );
        anyhow::ensure!(
            c.at_ms >= 0.0,
            "server {} joins or leaves before the run starts",
            c.server
        );
        anyhow::ensure!(
            changes[..k].iter().all(|o| o.server != c.server),
            "server {} joins or leaves twice: one change per server",
            c.server
        );
    }
    anyhow::ensure!(
        (0..servers).any(|s| changes.iter().all(|c| c.server != s)),
        "every server joins or leaves: keep one in the pool throughout"
    );
    Ok(())
}

/// From `at_ms` on, server `server`'s steps take `factor` times as long.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slowdown {
    pub server: usize,
    pub factor: f64,
    pub at_ms: f64,
}

impl ReplaySetup {
    /// The profile server `i` runs.
    pub fn profile_of(&self, i: usize) -> Profile {
        self.mixed.get(i).unwrap_or(&self.profile).clone()
    }
}

/// The chat body a client would send for `req`.
pub fn chat_body(model: &str, req: &SimRequest) -> String {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": req.prompt_text()}],
        "max_tokens": req.output_tokens,
    })
    .to_string()
}

/// A restart (`Topology::restart_at_ms`) must come before the last arrival: after it
/// nothing would be reported.
pub fn check_restart(topology: &Topology, requests: &[SimRequest]) -> anyhow::Result<()> {
    let Some(at) = topology.restart_at_ms else {
        return Ok(());
    };
    let last = requests.iter().map(|r| r.arrival_ms).fold(0.0, f64::max);
    anyhow::ensure!(
        at <= last,
        "the restart at {:.1} s comes after the last arrival ({:.1} s): nothing would be reported",
        at / 1000.0,
        last / 1000.0
    );
    Ok(())
}

/// Runs `policy` over `requests` and reports per-request outcomes.
pub fn run(setup: &ReplaySetup, policy: PolicyName, requests: &[SimRequest], progress: &dyn Fn(u64)) -> RunReport {
    run_until(setup, policy, requests, progress, &mut |_| false).0
}

/// `run`, but `stop` hears every completed request and ends the replay early by returning
/// true (e.g. once a latency objective can no longer be met): the report then covers the
/// requests completed so far, and the second value is true.
pub fn run_until(
    setup: &ReplaySetup,
    policy: PolicyName,
    requests: &[SimRequest],
    progress: &dyn Fn(u64),
    stop: &mut dyn FnMut(&Record) -> bool,
) -> (RunReport, bool) {
    driver::Driver::new(setup, policy, requests, progress, stop).run()
}

/// A request's body as a client sends it, parsed as the gateway parses it, and its blocks
/// as the engines hash them.
fn prepare(model: &str, req: &SimRequest, i: usize) -> (String, kvroute_core::ParsedRequest, Vec<u64>) {
    let body = chat_body(model, req);
    let parsed = match parse(ApiKind::Chat, body.as_bytes()) {
        Ok(p) => p,
        Err(err) => simulator_bug(&format!("request {i}'s body does not parse: {err}")),
    };
    let blocks = engine_blocks(&parsed.canonical, parsed.prompt_tokens.0);
    (body, parsed, blocks)
}

/// The replay renders every body and metrics text itself: one that does not parse is a bug
/// in the simulator, and skipping it would quietly skew every figure of the run.
#[allow(clippy::panic)]
fn simulator_bug(what: &str) -> ! {
    panic!("replay: {what}")
}

mod classes;
mod driver;
mod events;
mod gate;
mod topology;

#[cfg(test)]
mod tests;
