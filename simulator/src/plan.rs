//! Fleet sizing (`kvroute-sim plan`): per routing policy and GPU type, the smallest fleet
//! whose replay of a workload meets a latency objective, and what that fleet costs.
//!
//! - Objective: TTFT p95 ≤ X, and ITL p95 ≤ Y when given (p95 over requests of their mean
//!   inter-token latency, as `replay` reports it), with at most `MAX_FAILED` of the requests
//!   not completed.
//! - Search: `search::smallest` over 1..=`max_servers` (doubling, bisection, then a check that
//!   one server more passes too, since attainment is not strictly monotonic in fleet size).
//! - Each size is one replay per replica: replica 0 is the workload as given, replica k the
//!   same requests with jittered arrivals (`matrix::perturbed`, router seed + k). A size passes
//!   when most of its replicas do; its figures are medians over the replicas that ran to the
//!   end. A replica stops early once more requests have missed a threshold than a p95 allows:
//!   its attainment is then estimated from the requests it completed.
//! - Steady state: with `cold_ms` > 0 the objective is judged on the requests that arrive
//!   after it (the first fill of the caches left out, as `replay --cold-s` splits a run);
//!   failed requests still count against it, and the cost stays the whole run's.
//! - Fleets are homogeneous: `tp` GPUs of one type per server, every server alike; `mix`
//!   sizes fleets of two GPU types (a cheap one and a premium one, tiered or not).
//! - Cost: the fleet is assumed busy with this workload only. $/month = GPUs × $/GPU-hour ×
//!   730 h. $/million tokens = GPUs × $/GPU-hour × the replayed span (first arrival to last
//!   completion) ÷ the tokens processed in it (prompt + output tokens of completed
//!   requests, cached prompt tokens included) × 10⁶.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use serde::Serialize;

use crate::matrix::{median, perturbed};
use crate::policies::PolicyName;
use crate::profile::{Gpu, Profile};
use crate::replay::{run_until, ReplaySetup};
use crate::report::{Record, RunReport};
use crate::workload::SimRequest;

pub mod chart;
pub mod mix;
pub mod search;
mod spec;

pub use search::Outcome;
pub use spec::{gpu_name, Cost, Objective, Prices, HOURS_PER_MONTH, MAX_FAILED};

/// One replica of one fleet size.
#[derive(Clone, Debug, PartialEq)]
struct Trial {
    meets: bool,
    stopped_early: bool,
    attainment: f64,
    /// The whole run (its tokens and span price the fleet).
    report: RunReport,
    /// The steady state the objective is judged on (`Planner::cold_ms`); none: the whole run.
    steady: Option<RunReport>,
}

impl Trial {
    /// The requests the objective is judged on.
    fn judged(&self) -> &RunReport {
        self.steady.as_ref().unwrap_or(&self.report)
    }
}

/// One evaluated fleet size: medians over the replicas that ran to the end (`None` when
/// every replica stopped early).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Point {
    pub servers: usize,
    pub meets: bool,
    pub replicas: usize,
    pub stopped_early: usize,
    /// Fraction of requests whose TTFT (and ITL, when the objective has one) met the
    /// objective's threshold; failed requests count as missed. A replica that stopped early
    /// counts only the requests it completed (an estimate, from the first ones). This, the
    /// percentiles and the hit rate are of the judged requests (the steady state with
    /// `Planner::cold_ms`); evictions, failures, tokens and span are the whole run's.
    pub attainment: f64,
    pub ttft_p95_ms: Option<f64>,
    pub itl_p95_ms: Option<f64>,
    pub hit_rate: Option<f64>,
    pub evictions: Option<u64>,
    pub failed: usize,
    /// Prompt + output tokens of completed requests, and first arrival to last completion.
    pub tokens: u64,
    pub busy_s: f64,
}

/// A workload, an objective and how to replay it.
pub struct Planner<'a> {
    /// Every field but `profile` and `servers`, which each evaluation sets.
    pub base: ReplaySetup,
    pub requests: &'a [SimRequest],
    pub objective: Objective,
    pub replicas: u64,
    /// Stop a replica once it cannot meet the objective any more.
    pub early_stop: bool,
    /// Replay a size's replicas in threads of their own (when cores outnumber searches).
    pub parallel_replicas: bool,
    /// Judge the objective on the requests arriving from this many ms on (0: all of them).
    pub cold_ms: f64,
}

impl Planner<'_> {
    /// Replays `servers` servers of `profile` under `policy`, every replica.
    pub fn evaluate(&self, policy: PolicyName, profile: &Profile, servers: usize) -> Point {
        let fleet = ReplaySetup {
            classes: None,
            profile: profile.clone(),
            servers,
            mixed: Vec::new(),
            ..self.base.clone()
        };
        self.evaluate_fleet(policy, &fleet)
    }

    /// Replays `fleet` (the base setup with its servers, and its router configuration, set)
    /// under `policy`, every replica.
    pub fn evaluate_fleet(&self, policy: PolicyName, fleet: &ReplaySetup) -> Point {
        let servers = fleet.servers;
        let replica = |k: u64| {
            let setup = ReplaySetup {
                seed: fleet.seed.wrapping_add(k),
                ..fleet.clone()
            };
            self.trial(&setup, policy, &perturbed(self.requests, k))
        };
        let ks = 0..self.replicas.max(1);
        let trials: Vec<Trial> = if self.parallel_replicas && ks.end > 1 {
            std::thread::scope(|scope| {
                let handles: Vec<_> = ks.map(|k| scope.spawn(move || replica(k))).collect();
                // A replica that panicked must not vanish from the verdict.
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                    .collect()
            })
        } else {
            ks.map(replica).collect()
        };
        summarise(servers, &trials)
    }

    fn trial(&self, setup: &ReplaySetup, policy: PolicyName, requests: &[SimRequest]) -> Trial {
        let obj = self.objective;
        let cold_ms = self.cold_ms;
        let judged: Vec<&SimRequest> = requests.iter().filter(|r| r.arrival_ms >= cold_ms).collect();
        let ttft_allowed = misses_allowed(judged.len());
        let itl_allowed = misses_allowed(judged.iter().filter(|r| r.output_tokens > 1).count());
        let (mut ttft_misses, mut itl_misses) = (0, 0);
        let mut stop = |r: &Record| {
            if r.arrival_ms < cold_ms {
                return false;
            }
            ttft_misses += usize::from(r.ttft_ms > obj.ttft_p95_ms);
            itl_misses += usize::from(obj.itl_p95_ms.is_some_and(|y| r.output_tokens > 1 && r.itl_ms > y));
            self.early_stop && (ttft_misses > ttft_allowed || itl_misses > itl_allowed)
        };
        let (report, stopped_early) = run_until(setup, policy, requests, &|_| {}, &mut stop);
        let steady_run = (cold_ms > 0.0).then(|| report.phase(cold_ms, f64::INFINITY));
        let steady = steady_run.as_ref().unwrap_or(&report);
        let missed = steady.records.iter().filter(|r| !obj.met_by(r)).count();
        let n = judged.len().max(1) as f64;
        // A replay stopped early has completed only its first requests: its share is an
        // estimate from those (a bound would sit at the target by construction). A failed
        // request counts as missed in the judged window whenever it arrived.
        let attainment = if stopped_early {
            1.0 - missed as f64 / steady.records.len().max(1) as f64
        } else {
            (1.0 - (missed + report.failed) as f64 / n).max(0.0)
        };
        let meets = !stopped_early
            && report.failed as f64 <= MAX_FAILED * requests.len().max(1) as f64
            && !steady.records.is_empty()
            && steady.ttft_ms.p95 <= obj.ttft_p95_ms
            && obj.itl_p95_ms.is_none_or(|y| steady.itl_ms.p95 <= y);
        Trial {
            meets,
            stopped_early,
            attainment,
            report,
            steady: steady_run,
        }
    }
}

/// How many of `n` values may exceed a threshold while their p95 (as `Percentiles::of`
/// takes it: the value at rank round((n − 1) · 0.95)) stays within it. It never falls as
/// `n` grows, so counting against all requests is safe when some do not complete.
fn misses_allowed(n: usize) -> usize {
    let last = n.saturating_sub(1);
    last - ((last as f64) * 0.95).round() as usize
}

fn summarise(servers: usize, trials: &[Trial]) -> Point {
    let full: Vec<&RunReport> = trials.iter().filter(|t| !t.stopped_early).map(|t| &t.report).collect();
    let judged: Vec<&RunReport> = trials.iter().filter(|t| !t.stopped_early).map(Trial::judged).collect();
    let med = |f: &dyn Fn(&RunReport) -> f64| (!full.is_empty()).then(|| median(full.iter().map(|r| f(r)).collect()));
    let med_judged =
        |f: &dyn Fn(&RunReport) -> f64| (!judged.is_empty()).then(|| median(judged.iter().map(|r| f(r)).collect()));
    let tokens = |r: &RunReport| r.records.iter().map(|x| x.prompt_tokens + x.output_tokens).sum::<u64>() as f64;
    Point {
        servers,
        meets: trials.iter().filter(|t| t.meets).count() * 2 > trials.len(),
        replicas: trials.len(),
        stopped_early: trials.len() - full.len(),
        attainment: median(trials.iter().map(|t| t.attainment).collect()),
        ttft_p95_ms: med_judged(&|r| r.ttft_ms.p95),
        itl_p95_ms: med_judged(&|r| r.itl_ms.p95),
        hit_rate: med_judged(&|r| r.prefix_hit_rate),
        evictions: med(&|r| r.evictions as f64).map(|e| e.round() as u64),
        failed: med(&|r| r.failed as f64).map_or(0, |f| f.round() as usize),
        tokens: med(&tokens).map_or(0, |t| t.round() as u64),
        busy_s: med(&busy_s).unwrap_or(0.0),
    }
}

/// First arrival to last completion, in seconds.
fn busy_s(r: &RunReport) -> f64 {
    let first = r.records.iter().map(|x| x.arrival_ms).fold(f64::MAX, f64::min);
    let last = r.records.iter().map(|x| x.finish_ms).fold(0.0, f64::max);
    ((last - first) / 1000.0).max(0.0)
}

/// One policy on one GPU type: the search's outcome and every size it evaluated.
#[derive(Clone, Debug, Serialize)]
pub struct Sizing {
    #[serde(serialize_with = "as_string")]
    pub policy: PolicyName,
    #[serde(serialize_with = "gpu_as_name")]
    pub gpu: Gpu,
    pub tp: u32,
    /// The smallest confirmed size, or `None` when not met up to the largest size.
    pub servers: Option<usize>,
    /// A smaller size passed but one server more failed: the answer is above it.
    pub larger_needed: bool,
    /// Every evaluated size, smallest first.
    pub points: Vec<Point>,
    /// The answer's cost, once priced (`priced`).
    pub cost: Option<Cost>,
}

fn as_string<S: serde::Serializer>(p: &PolicyName, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&p.to_string())
}

fn gpu_as_name<S: serde::Serializer>(g: &Gpu, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&gpu_name(*g))
}

impl Sizing {
    /// The evaluated point at the answer.
    pub fn answer(&self) -> Option<&Point> {
        self.servers.and_then(|n| self.points.iter().find(|p| p.servers == n))
    }

    /// The sizing with its answer's cost at `usd_per_gpu_hour`.
    pub fn priced(self, usd_per_gpu_hour: f64) -> Sizing {
        let cost = self.cost_at(usd_per_gpu_hour);
        Sizing { cost, ..self }
    }

    /// The answer's cost at `usd_per_gpu_hour`.
    pub fn cost_at(&self, usd_per_gpu_hour: f64) -> Option<Cost> {
        let p = self.answer()?;
        Some(Cost::of(
            (p.servers as u64) * u64::from(self.tp),
            usd_per_gpu_hour,
            p.busy_s,
            p.tokens,
        ))
    }
}

impl Planner<'_> {
    /// Sizes every (policy, profile) pair, `jobs` searches at a time (each search is
    /// sequential: its next size depends on the last); `progress` hears each evaluated size.
    pub fn size_all(
        &self,
        policies: &[PolicyName],
        profiles: &[Profile],
        max_servers: usize,
        jobs: usize,
        progress: &(dyn Fn(&str) + Sync),
    ) -> Vec<Sizing> {
        let tasks: Vec<(PolicyName, &Profile)> = profiles
            .iter()
            .flat_map(|p| policies.iter().map(move |pol| (*pol, p)))
            .collect();
        in_parallel(&tasks, jobs, &|(policy, profile)| {
            self.size(*policy, profile, max_servers, progress)
        })
    }

    /// One search: the smallest confirmed size of `profile` servers for `policy`.
    pub fn size(
        &self,
        policy: PolicyName,
        profile: &Profile,
        max_servers: usize,
        progress: &(dyn Fn(&str) + Sync),
    ) -> Sizing {
        let mut points: Vec<Point> = Vec::new();
        let label = format!("{policy} on {}", gpu_name(profile.gpu));
        let found = search::smallest(max_servers, &mut |n| {
            let p = self.evaluate(policy, profile, n);
            progress(&format!("{label}: {}", chart::describe(&p, &self.objective)));
            let meets = p.meets;
            points.push(p);
            meets
        });
        points.sort_by_key(|p| p.servers);
        let (servers, larger_needed) = match found.outcome {
            Outcome::Met { servers, larger_needed } => (Some(servers), larger_needed),
            Outcome::NotMet => (None, false),
        };
        Sizing {
            policy,
            gpu: profile.gpu,
            tp: profile.tp,
            servers,
            larger_needed,
            points,
            cost: None,
        }
    }
}

/// `run` on every task, `jobs` at a time, the results in the tasks' order.
fn in_parallel<T: Sync, R: Send>(tasks: &[T], jobs: usize, run: &(dyn Fn(&T) -> R + Sync)) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..tasks.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs.clamp(1, tasks.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(task) = tasks.get(i) else { break };
                let result = run(task);
                if let Ok(mut r) = results.lock() {
                    r[i] = Some(result);
                }
            });
        }
    });
    results.into_inner().unwrap_or_default().into_iter().flatten().collect()
}

#[cfg(test)]
mod tests;
